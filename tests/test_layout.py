"""The folder tree is the layer map (``docs/design.md``, "Where things live"): each
package of ``kvfs/`` imports only the packages below it, no two modules import each
other even indirectly, and the on-device format is a leaf with one home.

Every import counts: at module level, inside a function (a "lazy" import hides a
cycle, it does not remove one) and under ``TYPE_CHECKING`` (a type named across layers
is a dependency across layers)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvfs

ROOT = Path(kvfs.__file__).parent

ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "format": {"common"},
    "devices": {"format", "common"},
    "index": {"devices", "format", "common"},
    "log": {"devices", "format", "common"},
    "evict": {"index", "log", "devices", "format", "common"},
    "store": {"evict", "index", "log", "devices", "format", "common"},
    "cluster": {"store", "format", "common"},
    "fuse": {"store", "common"},
    "client": {"devices", "format", "common"},
    "cli": {"fuse", "cluster", "store", "evict", "index", "log", "devices", "format", "common"},
    "testing": {"cli", "store", "evict", "index", "log", "devices", "format", "common"},
}
"""Package -> the packages it may import (besides itself). The order, bottom up:
common, format, devices, {index, log}, evict, store, {cluster, fuse}, cli, testing;
client (in the engine's process) stands beside the daemon and shares only the bottom."""

TOP_LEVEL = {
    "kvfs": set(),
    "kvfs.__main__": {"cli"},
    "kvfs.direct": {"client"},  # public names engine configurations use
    "kvfs.lmcache_plugin": {"client"},
    "kvfs.sglang_storage": {"client"},
    "kvfs.vllm_tier": {"client"},
}


def module_name(path: Path) -> str:
    parts = ("kvfs", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> Iterator[tuple[str, int]]:
    """(imported kvfs module, line) for every import statement in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvfs":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.split(".")[0] != "kvfs":
                continue
            for alias in node.names:  # `from kvfs.x import y`: y may be a module
                sub = f"{base}.{alias.name}"
                yield (sub if sub in known else base), node.lineno


def graph() -> dict[str, dict[str, int]]:
    mods = modules()
    known = set(mods)
    edges: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges[name] = {}
        for target, line in imports_of(name, path, known):
            while target not in known:  # an attribute path: its nearest module
                target = target.rpartition(".")[0]
            if target != name:
                edges[name].setdefault(target, line)
    return edges


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else module


def test_the_scan_sees_every_package_and_its_imports() -> None:
    edges = graph()
    assert {layer(m) for m in edges} == set(ALLOWED) | set(TOP_LEVEL)
    assert sum(len(e) for e in edges.values()) > 200, "the scan found almost no imports"
    assert "kvfs.store.facade" in edges["kvfs.fuse.ops"]


def test_each_package_imports_only_the_layers_below_it() -> None:
    wrong = []
    for module, targets in graph().items():
        mine = layer(module)
        allowed = TOP_LEVEL.get(mine, ALLOWED.get(mine, set()))
        for target, line in targets.items():
            theirs = layer(target)
            if theirs != mine and theirs not in allowed and target != "kvfs":
                path = modules()[module].relative_to(ROOT.parent)
                wrong.append(f"{path}:{line}: {module} imports {target} ({mine} -> {theirs})")
    assert not wrong, "\n".join(wrong)


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(edges.get(nxt, {}))))
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_no_import_cycles_between_modules() -> None:
    found = cycles(graph())
    assert not found, found


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


# Modules outside kvfs/format that pack bytes, and why none of them are device bytes.
NOT_DEVICE_BYTES = {
    "devices/device.py": "ioctl arguments and results (kernel ABI)",
    "devices/identity.py": "an ioctl's result (kernel ABI)",
}


def test_every_device_record_is_packed_inside_the_format_package() -> None:
    """``docs/format.md`` has one executable form, ``kvfs/format/``: no other module
    builds a ``struct`` record (the exceptions above pack kernel or memory bytes)."""
    found: dict[str, list[int]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.parent.name == "format":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "struct"
                and node.attr in ("Struct", "pack", "pack_into", "unpack", "unpack_from")
            ):
                found.setdefault(str(path.relative_to(ROOT)), []).append(node.lineno)
    assert found, "the scan found nothing at all: it is not looking at kvfs"
    assert set(found) == set(NOT_DEVICE_BYTES), found


def test_product_code_never_imports_the_test_support() -> None:
    wrong = [
        f"{m} imports {t}"
        for m, targets in graph().items()
        for t in targets
        if layer(t) == "testing" and layer(m) != "testing"
    ]
    assert not wrong, wrong
