# kvfs — see README.md
PY ?= .venv/bin/python
VENV = .venv
DEMO_DIR ?= /tmp/kvfs-demo

.PHONY: install engines-env demo test test-banner test-deps lint format bench trace clean

BINDIR ?= /usr/local/bin
DOCDIR ?= /usr/local/share/doc/kvfs

# The venv, then the kvfs command on PATH: $(BINDIR)/kvfs -> this checkout's
# .venv/bin/kvfs (mount -t fuse.kvfs and fstab run `kvfs` from mount's fixed PATH).
install: $(VENV)/.installed
	@if [ -w $(BINDIR) ]; then \
	  ln -sfn $(CURDIR)/$(VENV)/bin/kvfs $(BINDIR)/kvfs && echo "$(BINDIR)/kvfs -> $(CURDIR)/$(VENV)/bin/kvfs"; \
	  mkdir -p $(DOCDIR) && cp docs/operations.md $(DOCDIR)/; \
	else echo "$(BINDIR) is not writable: run kvfs as $(CURDIR)/$(VENV)/bin/kvfs (or make install as root)"; fi

$(VENV)/.installed: pyproject.toml
	@command -v fusermount3 >/dev/null && pkg-config --exists fuse3 || { \
	  echo "installing fuse3 libfuse3-dev pkg-config (needs root)"; \
	  apt-get update -qq && apt-get install -y -qq fuse3 libfuse3-dev pkg-config; }
	@ldconfig -p | grep -q libibverbs.so.1 && ldconfig -p | grep -q librdmacm.so.1 && \
	  ldconfig -p | grep -q libnuma.so.1 || { \
	  echo "installing libibverbs1 librdmacm1 libnuma1 (the Mooncake client of --cluster; needs root)"; \
	  apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 >/dev/null; }
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev,cluster]'
	touch $@

demo: install
	$(PY) tools/demo.py --dir $(DEMO_DIR)

# The real LMCache / vLLM fs tier / SGLang HiCacheFile code used by tests/engines/test_engines.py
# (CPU builds, ~3.7 GB, ~4 min the first time; a no-op once built).
engines-env:
	tools/engines_env.sh

# tmux (the live view's test), systemd-analyze (the unit's), util-linux mount (mount -t)
test-deps:
	@command -v tmux >/dev/null && command -v systemd-analyze >/dev/null || { \
	  echo "installing tmux systemd (needs root; used by the tests)"; \
	  apt-get update -qq && apt-get install -y -qq tmux systemd >/dev/null; }

# The first prerequisite says up front what runs and for how long (make runs them in order).
test: test-banner install engines-env test-deps
	KVFS_ENGINES_VENV=$(CURDIR)/.venv-engines $(PY) -m pytest -q

test-banner:
	@echo "make test: ~800 tests (unit, real mounts, crash torture, the real engines), ~25-35 min$$( \
	  [ -f .venv-engines/.kvfs-engines ] || echo '; first it builds .venv-engines: ~4 min, 3.7 GB')"

lint: install
	$(VENV)/bin/ruff check kvfs tests tools
	$(VENV)/bin/ruff format --check kvfs tests tools
	$(VENV)/bin/mypy kvfs
	$(VENV)/bin/mypy tests

format: install
	$(VENV)/bin/ruff format kvfs tests tools
	$(VENV)/bin/ruff check --fix kvfs tests tools

bench: install
	$(VENV)/bin/pip install -q -e '.[bench]'
	$(PY) tools/bench.py --out docs/bench

# The eviction trace suite (docs/eviction.md): table on stdout, JSON + SVG in docs/bench.
# MOONCAKE_DIR=.../Mooncake/FAST25-release/traces adds Mooncake's real traces (held out),
# and the suite once more with their partial last chunks sized (trace_suite_sized.*).
MOONCAKE_DIR ?=
trace: install
	$(PY) tools/kvtrace.py
	$(PY) tools/trace_suite.py --out docs/bench $(if $(MOONCAKE_DIR),--mooncake $(MOONCAKE_DIR))
	$(if $(MOONCAKE_DIR),$(PY) tools/trace_suite.py --sized --out docs/bench --mooncake $(MOONCAKE_DIR))

clean:
	rm -rf $(VENV) .venv-engines build *.egg-info .pytest_cache .mypy_cache .ruff_cache
