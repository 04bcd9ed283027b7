"""docs/config.md stays true to the schema: regenerated, compared, and cross-checked key by key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlcore.config import SCHEMA_KEYS, load_config
from tools import docgen
from rlcore.config.loader import CHOICE_KEYS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "config.md"

#: Every key of the seed's fast_train_config.yaml (section 4 of the tuning guide) with its value there.
SEED_TEMPLATE = {
    "data.train_files": ["/data/parquet/train-00000.parquet", "/data/parquet/train-00001.parquet"],
    "data.val_files": "/data/parquet/val.parquet",
    "data.cache_dir": "/local_ssd/.cache/verl",
    "data.num_workers": 24,
    "data.prefetch_factor": 6,
    "data.filter_overlong_prompts": True,
    "data.max_prompt_length": 1024,
    "actor.remeshing.enabled": True,
    "actor.remeshing.generation_shard_size": 2,
    "actor.remeshing.training_shard_size": 4,
    "actor.fsdp.use_orig_params": True,
    "actor.fsdp.sharding_strategy": "FULL_SHARD",
    "actor.fsdp.cpu_offload": False,
    "reward_model.device": "cuda:4",
    "reward_model.offload": True,
    "reward_model.dtype": "bf16",
    "ppo.rollout_batch_size": 40,
    "ppo.generation.batch_size": 20,
    "ppo.generation.max_new_tokens": 128,
    "ppo.generation.temperature": 0.7,
    "ppo.generation.top_p": 0.95,
    "ppo.kl_coeff": 0.1,
    "ppo.cliprange_value": 0.2,
    "trainer.save_steps": 1000,
    "trainer.log_steps": 50,
    "trainer.enable_profiling": False,
    "trainer.gradient_accumulation_steps": 4,
    "trainer.max_steps": 10000,
    "trainer.eval_steps": 200,
    "fsdp.sync_module_states": False,
    "fsdp.use_orig_params": True,
    "fsdp.sharding_strategy": "FULL_SHARD",
}


@pytest.fixture(scope="module")
def text() -> str:
    return DOC.read_text(encoding="utf-8")


def documented_rows(markdown: str) -> dict[str, str]:
    """``key -> row`` for every table row whose first cell is a code span."""
    rows = {}
    for line in markdown.splitlines():
        m = re.match(r"\| `([^`]+)` \|", line)
        if m:
            rows[m.group(1)] = line
    return rows


def leaf_keys() -> list[str]:
    sections = {k for k in SCHEMA_KEYS for other in SCHEMA_KEYS if other.startswith(k + ".")}
    return [k for k in SCHEMA_KEYS if k not in sections]


def test_generated_part_matches_the_schema(text):
    current = docgen.generated_part(text, "config", str(DOC))
    assert current == docgen.config_reference(), (
        "docs/config.md is out of date with rlcore.config.schema: run "
        "`python tools/docgen.py --write docs/config.md`")


def test_every_schema_key_is_documented_and_no_other(text):
    rows = documented_rows(docgen.generated_part(text, "config", str(DOC)))
    leaves = leaf_keys()
    assert len(leaves) > 100
    missing = [k for k in leaves if k not in rows]
    stale = [k for k in rows if k not in SCHEMA_KEYS]
    assert not missing, f"schema keys missing from docs/config.md: {missing}"
    assert not stale, f"docs/config.md documents keys the schema does not have: {stale}"
    for key in leaves:
        meaning = rows[key].rstrip(" |").rsplit(" | ", 1)[-1]
        assert meaning.strip(), f"{key} has an empty description"


def test_allowed_values_are_named_in_the_description(text):
    rows = documented_rows(text)
    assert {"ppo.kl_estimator", "ppo.loss_agg", "algorithm.adv_estimator", "ppo.rollout_is",
            "fsdp.sharding_strategy", "actor.dtype", "actor.rollout_engine.attention"} <= set(CHOICE_KEYS)
    for key, kind in CHOICE_KEYS.items():
        for value in kind.values():
            assert re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", rows[key]), (
                f"'{key}' accepts {value!r} but its '#:' comment does not name it: {rows[key]}")


def test_seed_template_is_accepted_and_mapped(text):
    overrides = []
    for key, value in SEED_TEMPLATE.items():
        if isinstance(value, list):
            value = "[" + ",".join(value) + "]"
        elif isinstance(value, bool):
            value = str(value).lower()
        overrides.append(f"{key}={value}")
    cfg = load_config([], overrides)
    assert cfg.actor.remeshing.training_shard_size == 4 and cfg.fsdp.sync_module_states is False
    assert list(cfg.data.val_files) == ["/data/parquet/val.parquet"]
    seed_table = text.split("## The seed's `fast_train_config.yaml`", 1)[1].split("\n## ", 1)[0]
    mapped = documented_rows(seed_table)
    assert sorted(mapped) == sorted(SEED_TEMPLATE), "the seed table must list exactly the template's keys"


def test_field_comments_follow_inheritance():
    rows = documented_rows(docgen.config_reference())
    # CriticConfig redeclares lr and model_path with their own comments; ActorConfig inherits ModelRoleConfig's.
    assert "only used with" in rows["critic.lr"] and "initialise from the actor" in rows["critic.model_path"]
    assert "demo's tiny model" in rows["actor.model_path"]
    assert "Learning rate of this role's optimizer" in rows["actor.lr"]
    assert "`\"FULL_SHARD\"`" in rows["fsdp.sharding_strategy"] and "`null`" in rows["actor.fsdp.sharding_strategy"]


def test_a_field_without_comment_is_refused():
    import dataclasses

    @dataclasses.dataclass
    class Undocumented:
        #: Documented.
        a: int = 1
        b: int = 2

    with pytest.raises(ValueError, match=r"Undocumented\.b \('x\.b'\) has no '#:' comment"):
        list(docgen.sections(Undocumented, "x."))


def test_check_and_write_keep_the_hand_written_part(tmp_path, capsys):
    begin, end = docgen.markers("config")
    page = tmp_path / "config.md"
    page.write_text(f"# intro\n\n{begin}\nstale\n{end}\nfooter\n", encoding="utf-8")
    assert docgen.main(["--check", str(page)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert docgen.main(["--write", str(page)]) == 0
    assert docgen.main(["--check", str(page)]) == 0
    written = page.read_text(encoding="utf-8")
    assert written.startswith("# intro\n") and written.endswith(f"{end}\nfooter\n") and "stale" not in written
    page.write_text("no markers\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no generated part"):
        docgen.main(["--check", str(page)])
