"""Load SGLang's own OpenAI protocol models (and its SSE chunk builder) without its heavy deps.

The sglang wheel is installed with ``--no-deps`` (Makefile); its parent packages would import
torch, so they are registered as empty modules first and the two leaf modules are loaded from
their files. ``sglang.utils`` gets the one helper ``protocol`` imports.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

_PARENTS = ("sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.openai")


def _package_dir() -> Path:
    loaded = sys.modules.get("sglang")  # registered by an earlier load: find_spec refuses it
    if loaded is not None and getattr(loaded, "__path__", None):
        return Path(next(iter(loaded.__path__)))
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sglang is not installed; run `make install`")
    return Path(next(iter(spec.submodule_search_locations)))


def _load(name: str, path: Path) -> types.ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load() -> tuple[types.ModuleType, types.ModuleType]:
    """``(protocol, sse_utils)`` from the installed sglang wheel (loaded once per process)."""
    leaves = ("sglang.srt.entrypoints.openai.protocol", "sglang.srt.entrypoints.openai.sse_utils")
    if all(name in sys.modules for name in leaves):
        return sys.modules[leaves[0]], sys.modules[leaves[1]]
    root = _package_dir()
    for name in _PARENTS:
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(root.parent / name.replace(".", "/"))]
            sys.modules[name] = module
    if "sglang.utils" not in sys.modules:
        utils = types.ModuleType("sglang.utils")

        def convert_json_schema_to_str(schema: Any) -> str:
            return schema if isinstance(schema, str) else json.dumps(schema)

        utils.convert_json_schema_to_str = convert_json_schema_to_str  # type: ignore[attr-defined]
        sys.modules["sglang.utils"] = utils
    base = root / "srt" / "entrypoints" / "openai"
    protocol = _load("sglang.srt.entrypoints.openai.protocol", base / "protocol.py")
    sse_utils = _load("sglang.srt.entrypoints.openai.sse_utils", base / "sse_utils.py")
    return protocol, sse_utils


def load_kv_events() -> types.ModuleType:
    """SGLang's KV event classes (``srt/disaggregation/kv_events.py``: ``KVEventBatch``,
    ``BlockStored``...) from the installed wheel. The module's two imports that are not about the
    events (``runtime_context.get_parallel`` and ``utils.network.NetworkAddress``, used by its
    publisher and config helpers) would pull in psutil and torch: they get empty stand-ins."""
    name = "sglang.srt.disaggregation.kv_events"
    if name in sys.modules:
        return sys.modules[name]
    root = _package_dir()
    for parent in ("sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.utils"):
        if parent not in sys.modules:
            module = types.ModuleType(parent)
            module.__path__ = [str(root.parent / parent.replace(".", "/"))]
            sys.modules[parent] = module
    for leaf, attr in (
        ("sglang.srt.runtime_context", "get_parallel"),
        ("sglang.srt.utils.network", "NetworkAddress"),
    ):
        if leaf not in sys.modules:
            stand_in = types.ModuleType(leaf)
            setattr(stand_in, attr, None)
            sys.modules[leaf] = stand_in
    return _load(name, root / "srt" / "disaggregation" / "kv_events.py")
