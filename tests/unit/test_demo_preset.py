"""The demo is a preset the command line applies: the trainer needs ``actor.model_path``, and
``rlcore train`` fills it in with the demo's tiny model where it is empty."""

from __future__ import annotations

import logging
import os

import pytest

from rlcore.config import load_config
from rlcore.errors import ConfigError
from rlcore.plugin_manager import build_plugin_manager
from rlcore.protocols import DistInfo


def test_a_trainer_without_a_model_path_names_the_key_before_anything_loads(tmp_path, monkeypatch):
    import rlcore.demo
    from rlcore.trainer import models
    from rlcore.trainer.loop import Trainer

    def forbidden(*a, **k):
        raise AssertionError("a model or tokenizer was built or loaded before the missing model path was named")

    for target, name in [(models, "load_tokenizer"), (models, "load_causal_lm"), (rlcore.demo, "build_model_dir")]:
        monkeypatch.setattr(target, name, forbidden)
    cfg = load_config([], [*rlcore.demo.DEMO_OVERRIDES, f"trainer.output_dir={tmp_path}/run"])
    with pytest.raises(ConfigError, match=r"actor\.model_path is not set"):
        Trainer(cfg, build_plugin_manager([]), DistInfo())
    assert not os.path.exists(tmp_path / "run" / "_demo")


def test_train_with_data_and_no_model_gets_the_demo_model_and_a_warning(tmp_path, monkeypatch, caplog):
    from rlcore import cli
    from rlcore.data.synthetic import write_parquet_shards

    seen = []

    class NoTraining:  # what the trainer receives
        status = "completed"

        def __init__(self, cfg, *args):
            seen.append(str(cfg.actor.model_path))

        def train(self):
            return {}

    monkeypatch.setattr("rlcore.trainer.loop.Trainer", NoTraining)
    files = write_parquet_shards(str(tmp_path / "d"), [32])
    run = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        code = cli.main(["train", f"trainer.output_dir={run}", f"data.train_files=[{files[0]}]",
                         "trainer.max_steps=0", "trainer.progress=false", "trainer.export_final=false"])
    assert code == 0
    assert seen == [str(run / "_demo" / "demo-model")]
    assert os.path.isfile(run / "_demo" / "demo-model" / "config.json")
    assert "actor.model_path is not set: the policy is the demo's tiny model" in caplog.text
