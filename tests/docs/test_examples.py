"""Every YAML under examples/ is a valid rlcore config naming only installed plugins."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcore.config import load_config
from rlcore.plugin_manager import check_names

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for suffix in ("*.yaml", "*.yml") for p in (ROOT / "examples").rglob(suffix))


def test_there_are_examples():
    assert EXAMPLES, "examples/ holds no YAML file"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_example_validates(path):
    cfg = load_config([str(path)])  # raises ConfigError listing every problem
    check_names(list(cfg.plugins))  # raises PluginError for a name no installed plugin has
