"""Tests of the tools in ``tools/``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_tool(name: str) -> ModuleType:
    """Import ``tools/<name>.py`` as module ``name`` (the tools are scripts, not a
    package; their own imports of each other resolve through ``tools/``)."""
    tools = Path(__file__).resolve().parents[2] / "tools"
    sys.path.insert(0, str(tools))
    spec = importlib.util.spec_from_file_location(name, tools / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
