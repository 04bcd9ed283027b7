"""User dataset classes named by ``data.custom_cls``: a ``.py`` file or ``pkg://module.path``, plus a class name."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

from rlcore.config.schema import CustomClsConfig
from rlcore.errors import DataError

PKG_PREFIX = "pkg://"


def _module_from_file(path: str) -> ModuleType:
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise DataError(f"data.custom_cls.path: file not found: {path}")
    stem = "".join(c if c.isalnum() else "_" for c in os.path.splitext(os.path.basename(full))[0])
    # A stable module name lets instances pickle by reference (DataLoader workers, checkpoints).
    name = f"rlcore_user_{stem}_{hashlib.sha1(full.encode()).hexdigest()[:10]}"
    mtime = os.stat(full).st_mtime_ns
    cached = sys.modules.get(name)
    if cached is not None and getattr(cached, "__rlcore_mtime__", None) == mtime:
        return cached
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise DataError(f"data.custom_cls.path: cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(name, None)
        raise DataError(f"data.custom_cls.path: importing {path} failed: {type(err).__name__}: {err}") from err
    module.__rlcore_mtime__ = mtime  # type: ignore[attr-defined]
    return module


def _module_from_package(spec: str) -> ModuleType:
    name = spec[len(PKG_PREFIX):].strip().strip("/").replace("/", ".")
    try:
        return importlib.import_module(name)
    except Exception as err:
        raise DataError(f"data.custom_cls.path: cannot import module '{name}' ({spec}): "
                        f"{type(err).__name__}: {err}") from err


def load_custom_class(cfg: CustomClsConfig) -> type:
    """Import ``cfg.path`` and return the class ``cfg.name`` defined there.

    :raises DataError: missing file or module, import failure, or no such class (listing the classes found).
    """
    if not cfg.path or not cfg.name:
        raise DataError("data.custom_cls.path and data.custom_cls.name must be given together")
    module = _module_from_package(cfg.path) if cfg.path.startswith(PKG_PREFIX) else _module_from_file(cfg.path)
    cls = getattr(module, cfg.name, None)
    if not isinstance(cls, type):
        found = sorted(k for k, v in vars(module).items()
                       if isinstance(v, type) and v.__module__ == module.__name__)
        raise DataError(f"data.custom_cls.name: no class '{cfg.name}' in {cfg.path}; "
                        f"classes defined there: {', '.join(found) or 'none'}")
    return cls


def build_custom_dataset(cfg: CustomClsConfig, data_files: list[str], prompt_key: str) -> Any:
    """Build ``cls(data_files, prompt_key=..., **kwargs)``."""
    cls = load_custom_class(cfg)
    kwargs = dict(cfg.kwargs or {})
    try:
        return cls(data_files, prompt_key=prompt_key, **kwargs)
    except TypeError as err:
        raise DataError(f"data.custom_cls: {cfg.name}(data_files, prompt_key={prompt_key!r}, "
                        f"**{sorted(kwargs)}) failed: {err}") from err
