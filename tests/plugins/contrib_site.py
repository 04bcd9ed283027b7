"""Installing a contrib distribution for a test: into a temporary directory put on ``sys.path`` (its
metadata included, so its entry point is found as for a real install); the user's environment is
left as it was."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from importlib import metadata

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def has_entry_point(name: str) -> bool:
    return any(ep.name == name for ep in metadata.entry_points(group="rlcore.plugins"))


def install_contrib(distribution: str, plugin: str, module: str, target: str, *, force: bool = False) -> list[str]:
    """Install ``contrib/<distribution>`` (without its dependencies) into ``target`` unless the plugin
    is installed already (``force``: install all the same, e.g. for a child process that must find it);
    return the directories put on ``sys.path`` (empty: nothing was installed)."""
    if not force and has_entry_point(plugin) and importlib.util.find_spec(module):
        return []
    path = os.path.join(ROOT, "contrib", distribution)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile",
           "--target", target, path]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"installing {path} failed:\n{proc.stdout}\n{proc.stderr}")
    sys.path.insert(0, target)
    importlib.invalidate_caches()
    assert has_entry_point(plugin), f"the {plugin} entry point is not visible after installing {path}"
    return [target]


def subprocess_env(site: list[str], **extra: str) -> dict[str, str]:
    """The environment of a child ``rlcore`` process that sees the installed package."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [*site, os.environ.get("PYTHONPATH")])), **extra)
