"""docs/hooks.md stays true to rlcore.hookspecs, and every hook has a test (the datasette habit)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from rlcore import hookspecs, protocols
from tools import docgen

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "hooks.md"
TESTS = ROOT / "tests"

HOOK_NAMES = [name for name, _ in docgen.hook_specs()]


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def test_sources() -> str:
    # tests/docs is left out: its files name hooks only to check the others.
    files = [p for p in TESTS.rglob("*.py") if "docs" not in p.relative_to(TESTS).parts[:1]]
    return "\n".join(p.read_text(encoding="utf-8") for p in files)


def test_every_spec_is_found():
    defined = sorted(n for n, f in vars(hookspecs).items() if n.startswith("rlcore_") and inspect.isfunction(f))
    assert sorted(HOOK_NAMES) == defined and len(defined) >= 14
    assert set(hookspecs.FACTORY_HOOKS) <= set(HOOK_NAMES)


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_signature_and_docstring_are_documented(name, text):
    signature = docgen.hook_signature(name)
    assert signature == name + str(inspect.signature(getattr(hookspecs, name)))
    assert f"```python\n{signature}\n```" in text, (
        f"docs/hooks.md lacks the exact signature of {name}:\n{signature}\n"
        "run `python tools/docgen.py hooks --write docs/hooks.md`")
    doc = inspect.getdoc(getattr(hookspecs, name))
    assert doc and doc in text, f"docs/hooks.md lacks the docstring of {name}"


@pytest.mark.parametrize("name", HOOK_NAMES)
def test_every_hook_has_a_test(name, test_sources):
    assert re.search(rf"\b{name}\b", test_sources), f"no test under tests/ mentions {name}"


def test_generated_part_matches_the_code(text):
    assert docgen.generated_part(text, "hooks", str(DOC)) == docgen.hooks_reference(), (
        "docs/hooks.md is out of date: run `python tools/docgen.py hooks --write docs/hooks.md`")


def test_shapes_and_protocols():
    shapes = {name: docgen.hook_shape(name) for name in HOOK_NAMES}
    assert shapes["rlcore_register_rewards"] == "registry"
    assert [n for n, s in shapes.items() if s == "factory"] == list(hookspecs.FACTORY_HOOKS)
    assert shapes["rlcore_metrics"] == shapes["rlcore_train_end"] == "event"
    assert docgen.returned_protocol("rlcore_reshard_policy") is protocols.ReshardPolicy
    assert docgen.returned_protocol("rlcore_checkpoint_policy") is protocols.CheckpointPolicy
    assert docgen.returned_protocol("rlcore_dataset_provider") is None  # a torch Dataset, not an rlcore protocol
    reference = docgen.hooks_reference()
    for proto in (protocols.PlacementPolicy, protocols.ReshardPolicy, protocols.RewardBackend,
                  protocols.CheckpointPolicy):
        for meth in ("device_for", "prepare", "generation", "score", "should_save", "resume", "export"):
            if hasattr(proto, meth):
                assert f"def {meth}{inspect.signature(getattr(proto, meth))}:" in reference


def test_no_spec_is_firstresult():
    # RLCorePluginManager.build collects every answer itself; a firstresult spec would hide conflicts.
    for name in HOOK_NAMES:
        assert not getattr(hookspecs, name).rlcore_spec.get("firstresult")
