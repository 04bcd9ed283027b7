"""A dataset provider from a separately installed distribution (contrib/rlcore-textfile), found by entry point."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from rlcore.config.schema import DataConfig
from rlcore.protocols import DistInfo
from contrib_site import install_contrib, subprocess_env

SITE: list[str] = []  # where the fixture installed the package (empty: it was installed already)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The contrib package installed for this module (see :func:`install_contrib`)."""
    SITE.extend(install_contrib("rlcore-textfile", "textfile", "rlcore_textfile",
                                str(tmp_path_factory.mktemp("site"))))
    yield
    for target in SITE:
        sys.path.remove(target)
    SITE.clear()


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(f"{a} {b}\t{b}" for a in "abcd" for b in "efgh") + "\n")
    return str(path)


def test_selected_by_name_and_answers_for_text_files(installed, prompt_file, tiny_tokenizer):
    from rlcore.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(["textfile"])
    info = {i.name: i for i in pm.infos()}["textfile"]
    assert info.distribution == "rlcore-textfile" and info.hooks == ("rlcore_dataset_provider",)
    ds = pm.build("rlcore_dataset_provider", config=DataConfig(train_files=[prompt_file]),
                  tokenizer=tiny_tokenizer, split="train", dist=DistInfo())
    assert type(ds).__name__ == "TextFileDataset" and len(ds) == 16
    assert ds[0]["prompt"] == "a e" and ds[0]["ground_truth"] == "e" and ds[0]["input_ids"]


@pytest.mark.slow
def test_train_one_step_with_the_plugin(installed, prompt_file, tmp_path):
    if importlib.util.find_spec("rlcore.trainer.loop") is None:
        pytest.skip("rlcore.trainer.loop is not available: the train command cannot run yet")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlcore", "train", "--plugins", "textfile", f"data.train_files=[{prompt_file}]",
           f"data.val_files=[{prompt_file}]", "data.max_prompt_length=8", "trainer.max_steps=1",
           "ppo.rollout_batch_size=4", "ppo.generation.max_new_tokens=4", "trainer.eval_samples=4",
           "trainer.progress=false", "trainer.export_final=false", f"trainer.output_dir={run_dir}"]
    env = subprocess_env(SITE)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 1" in proc.stdout + proc.stderr
    assert os.path.isdir(run_dir / "checkpoints")
