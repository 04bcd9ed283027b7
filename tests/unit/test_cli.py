"""The rlcore command: errors before any model loads, config printing, plugin listing."""

import subprocess
import sys

import pytest

from rlcore.testing import run_cli


@pytest.fixture(autouse=True)
def _no_model_loading(monkeypatch):
    """Any attempt to load a model in these tests is a failure: errors must come first."""
    def boom(*a, **k):
        raise AssertionError("a model was loaded before the error was raised")

    monkeypatch.setattr("rlcore.trainer.models.load_causal_lm", boom)


def test_unknown_plugin_fails_before_loading_a_model():
    code, out, err = run_cli(["train", "--plugins", "nosuch"])
    assert code != 0
    assert "unknown plugin 'nosuch'" in err and "available plugins:" in err and "streaming" in err
    assert len(err.splitlines()) < 25  # one screen


def test_misspelled_key_points_to_the_right_one():
    code, out, err = run_cli(["train", "data.trian_files=x"])
    assert code != 0
    assert "data.train_files" in err


def test_missing_data_file_is_named(tmp_path):
    missing = tmp_path / "nope.parquet"
    code, out, err = run_cli(["train", f"data.train_files=[{missing}]"])
    assert code != 0 and "nope.parquet" in err


def test_missing_model_dir_is_named(tmp_path):
    code, out, err = run_cli(["validate", f"actor.model_path={tmp_path}/none"])
    assert code != 0 and "actor.model_path" in err


def test_config_prints_resolved_yaml_with_demo_preset():
    code, out, err = run_cli(["config", "ppo.kl_coeff=0.3", "--plugins", "sparse-logging"])
    assert code == 0
    assert "kl_coeff: 0.3" in out
    assert "- sparse-logging" in out
    assert "max_new_tokens: 6" in out  # the demo preset applies when no data is given


def test_config_from_seed_template():
    code, out, err = run_cli(["config", "--config_path", "examples/fast_train_config.yaml"])
    assert code == 0, err
    assert "generation_shard_size: 2" in out and "sync_module_states: false" in out


def test_validate_ok(tmp_path):
    code, out, err = run_cli(["validate", f"trainer.output_dir={tmp_path}/run"])
    assert code == 0, err
    assert "config OK" in out


def test_plugins_lists_name_distribution_version_hooks():
    code, out, err = run_cli(["plugins"])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["name", "distribution", "version", "default"]
    row = next(line for line in lines if line.startswith("defaults"))
    assert "rlcore" in row and "yes" in row and "dataset_provider" in row
    assert any(line.startswith("streaming") for line in lines)


def test_python_dash_m_entry():
    proc = subprocess.run([sys.executable, "-m", "rlcore", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and "rlcore" in proc.stdout


def test_missing_reward_model_fails_before_the_actor_loads(tmp_path):
    code, out, err = run_cli(["train", f"trainer.output_dir={tmp_path}/run", "reward_model.enable=true",
                              f"reward_model.path={tmp_path}/no-rm"])
    assert code != 0
    assert "no-rm" in err and "a model was loaded" not in err


def test_validate_checks_the_reward_model_directory(tmp_path, capsys):
    from rlcore.cli import main

    missing = tmp_path / "no-rm"
    assert main(["validate", f"trainer.output_dir={tmp_path}", "reward_model.enable=true",
                 f"reward_model.path={missing}"]) == 2
    assert f"reward_model.path '{missing}' does not exist" in capsys.readouterr().err
    causal = tmp_path / "causal"
    causal.mkdir()
    (causal / "config.json").write_text('{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}')
    assert main(["validate", f"trainer.output_dir={tmp_path}", "reward_model.enable=true",
                 f"reward_model.path={causal}"]) == 2
    assert "is not a sequence-classification model" in capsys.readouterr().err


def test_bad_world_size_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "abc")
    code, out, err = run_cli(["validate", f"trainer.output_dir={tmp_path}/run", "placement.rank_groups={reward: [0]}"])
    assert code != 0 and "WORLD_SIZE='abc' is not an integer" in err and "Traceback" not in err


def test_resume_target_and_reward_function_are_checked_before_anything_loads(tmp_path):
    code, out, err = run_cli(["validate", f"trainer.output_dir={tmp_path}/run", "trainer.resume=disabled"])
    assert code != 0 and "did you mean 'disable'" in err
    code, out, err = run_cli(["train", f"trainer.output_dir={tmp_path}/run", f"trainer.resume={tmp_path}/nope"])
    assert code != 0 and "no such checkpoint directory" in err and "a model was loaded" not in err
    code, out, err = run_cli(["validate", f"trainer.output_dir={tmp_path}/run",
                              f"custom_reward_function.path={tmp_path}/nofile.py", "custom_reward_function.name=f"])
    assert code != 0 and "nofile.py" in err
    reward = tmp_path / "reward.py"
    reward.write_text("def score(prompt, response):\n    return 0.0\n")
    code, out, err = run_cli(["train", f"trainer.output_dir={tmp_path}/run", f"custom_reward_function.path={reward}",
                              "custom_reward_function.name=scor"])
    assert code != 0 and "defines no function 'scor'" in err and "score" in err and "a model was loaded" not in err


def test_too_few_rows_for_one_batch_fails_before_tokenizing(tmp_path, monkeypatch):
    from rlcore.data.synthetic import write_parquet_shards

    def no_tokenizing(*a, **k):
        raise AssertionError("the data was tokenized before the error was raised")

    monkeypatch.setattr("rlcore.data.provider.load_prompt_table", no_tokenizing)
    files = write_parquet_shards(str(tmp_path / "d"), [6, 4])
    code, out, err = run_cli(["train", f"trainer.output_dir={tmp_path}/run", f"data.train_files=[{','.join(files)}]",
                              "ppo.rollout_batch_size=16"])
    assert code != 0 and "hold 10 rows in 2 file(s)" in err and "ppo.rollout_batch_size=16" in err


def test_reward_arguments_are_matched_with_the_data_columns_before_tokenizing(tmp_path, monkeypatch):
    from rlcore.data.synthetic import write_parquet_shards

    def no_tokenizing(*a, **k):
        raise AssertionError("the data was tokenized before the error was raised")

    monkeypatch.setattr("rlcore.data.provider.load_prompt_table", no_tokenizing)
    files = write_parquet_shards(str(tmp_path / "d"), [40])
    reward = tmp_path / "reward.py"
    reward.write_text("def score(prompt, response, answer_col, scale):\n    return 0.0\n"
                      "def fine(prompt, response, ground_truth):\n    return 0.0\n")
    args = ["validate", f"trainer.output_dir={tmp_path}/run", f"data.train_files=[{files[0]}]",
            "ppo.rollout_batch_size=8", f"custom_reward_function.path={reward}"]
    code, out, err = run_cli(args + ["custom_reward_function.name=score", "custom_reward_function.kwargs={scale: 2}"])
    assert code != 0 and "needs argument(s) answer_col" in err and "scale" not in err.split("needs")[1].split(",")[0]
    assert "columns: data_source, ground_truth, id, prompt" in err
    code, out, err = run_cli(args + ["custom_reward_function.name=fine"])
    assert code == 0, err


def test_a_device_the_machine_lacks_is_named_before_anything_loads(tmp_path):
    code, out, err = run_cli(["validate", f"trainer.output_dir={tmp_path}/run", "critic.device=cuda:64"])
    assert code != 0 and "critic.device='cuda:64' asks for" in err


def test_an_unknown_trainer_device_is_found_by_validate_as_by_train(tmp_path):
    code, out, err = run_cli(["validate", f"trainer.output_dir={tmp_path}/run", "trainer.device=tpu"])
    assert code != 0 and "trainer.device = 'tpu': use one of auto, cpu, cuda" in err


def test_every_preflight_problem_is_reported_together(tmp_path):
    code, out, err = run_cli(["validate", f"trainer.output_dir={tmp_path}/run", f"data.train_files=[{tmp_path}/no.parquet]",
                              "trainer.resume=disabled", f"custom_reward_function.path={tmp_path}/r.py",
                              "custom_reward_function.name=f", "reward_model.enable=true", "reward_model.offload=true",
                              f"reward_model.path={tmp_path}/rm"])
    assert code != 0 and "problems found before loading anything" in err
    for part in ("no.parquet", "did you mean 'disable'", "r.py", "needs the 'rm-offload' plugin", "reward_model.path"):
        assert part in err, part
    remesh = ["validate", f"trainer.output_dir={tmp_path}/run", "--plugins", "remesh",
              "actor.remeshing.training_shard_size=4", "actor.remeshing.generation_shard_size=3"]
    code, out, err = run_cli(remesh + ["trainer.nproc_per_node=2", "actor.remeshing.enabled=true",
                                       "trainer.resume=disabled"])
    # the remesh plugin's two size problems are listed one by one, next to the resume problem
    assert code != 0 and err.count("\n  - ") == 3 and "3 problems found" in err, err
    assert "'actor.remeshing.training_shard_size' = 4 does not divide the world size 2" in err
    assert "'actor.remeshing.generation_shard_size' = 3 does not divide the world size 2" in err
    # sizes matter only when remeshing is on and the world size is known before start
    code, out, err = run_cli(remesh + ["trainer.nproc_per_node=2"])
    assert code == 0, err
    code, out, err = run_cli(remesh + ["actor.remeshing.enabled=true"])
    assert code == 0, err
    code, out, err = run_cli(["validate", f"trainer.output_dir={tmp_path}/run", "actor.remeshing.enabled=true"])
    assert code != 0 and "actor.remeshing.enabled=true needs the 'remesh' plugin" in err


def test_checks_of_the_critic_are_skipped_when_the_algorithm_has_none(tmp_path):
    args = ["validate", f"trainer.output_dir={tmp_path}/run", "critic.lr=0", "critic.grad_clip=-1",
            f"critic.model_path={tmp_path}/no-critic"]
    code, out, err = run_cli(args)
    assert code != 0 and "'critic.lr' must be > 0" in err and "'critic.grad_clip' must be >= 0" in err
    code, out, err = run_cli(args[:2] + args[4:])
    assert code != 0 and "no-critic" in err
    for algo in ("grpo", "rloo"):
        code, out, err = run_cli(args + [f"algorithm.adv_estimator={algo}", "ppo.generation.n=2"])
        assert code == 0, err


def test_a_plugin_check_that_crashes_is_named(tmp_path, monkeypatch):
    from rlcore import cli
    from rlcore.config import load_config
    from rlcore.errors import PluginError
    from rlcore.hookspecs import hookimpl
    from rlcore.plugin_manager import build_plugin_manager

    class Buggy:
        @hookimpl
        def rlcore_preflight(self, config):
            return config["no_such_section"]["x"]

    def with_buggy(names):
        pm = build_plugin_manager(names)
        pm.register(Buggy(), name="buggy")
        return pm

    monkeypatch.setattr("rlcore.plugin_manager.build_plugin_manager", with_buggy)
    cfg = load_config([], [f"trainer.output_dir={tmp_path}/run"])
    with pytest.raises(PluginError, match=r"plugin 'buggy': its start-up check .*KeyError: 'no_such_section'"):
        cli.preflight(cfg, [])


def test_reward_arguments_are_not_checked_against_a_jsonl_first_record(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a b"}\n' + '{"prompt": "c d", "answer": "x"}\n' * 40)
    reward = tmp_path / "reward.py"
    reward.write_text("def score(prompt, response, answer):\n    return 0.0\n")
    code, out, err = run_cli(["validate", f"trainer.output_dir={tmp_path}/run", f"data.train_files=[{data}]",
                              "ppo.rollout_batch_size=8", f"custom_reward_function.path={reward}",
                              "custom_reward_function.name=score"])
    assert code == 0, err


def test_overrides_may_come_before_and_after_options(tmp_path):
    code, out, err = run_cli(["config", "ppo.kl_coeff=0.3", "--plugins", "remesh", "trainer.max_steps=7",
                              "ppo.kl_coeff=0.4"])
    assert code == 0, err
    assert "kl_coeff: 0.4" in out and "max_steps: 7" in out and "- remesh" in out
    code, out, err = run_cli(["config", "run.yaml"])
    assert code != 0 and "pass it as --config run.yaml" in err


def test_plugins_check_their_own_needs_with_the_other_preflight_checks(tmp_path, monkeypatch):
    from rlcore import cli
    from rlcore.config import load_config
    from rlcore.errors import PluginError, PreflightError
    from rlcore.hookspecs import hookimpl
    from rlcore.plugin_manager import build_plugin_manager

    class Needy:
        @hookimpl
        def rlcore_preflight(self, config, plugins):
            raise PluginError(f"plugin 'needy' needs a client (max_steps={config['trainer']['max_steps']}, "
                              f"plugins={plugins})")

    class Picky:  # an implementation may take only some of the arguments
        @hookimpl
        def rlcore_preflight(self, plugins):
            if "sparse-logging" in plugins:
                raise PluginError("plugin 'picky' does not go with sparse-logging")

    def with_needy(names):
        pm = build_plugin_manager(names)
        pm.register(Needy(), name="needy")
        pm.register(Picky(), name="picky")
        return pm

    monkeypatch.setattr("rlcore.plugin_manager.build_plugin_manager", with_needy)
    cfg = load_config([], [f"trainer.output_dir={tmp_path}/run", "trainer.max_steps=3", "trainer.resume=disabled"])
    with pytest.raises(PreflightError) as e:
        cli.preflight(cfg, ["sparse-logging"])
    text = str(e.value)
    assert "plugin 'needy' needs a client (max_steps=3, plugins=['sparse-logging'])" in text
    assert "plugin 'picky' does not go with sparse-logging" in text
    assert "did you mean 'disable'" in text and text.startswith("3 problems found before loading anything")


def test_missing_train_and_val_files_are_named_together(tmp_path):
    code, out, err = run_cli(["validate", f"trainer.output_dir={tmp_path}/run", f"data.train_files=[{tmp_path}/t.parquet]",
                              f"data.val_files=[{tmp_path}/v.parquet]"])
    assert code != 0 and "data.train_files: 1 of 1 input(s) not found" in err and "v.parquet" in err, err


def test_a_config_without_data_says_it_trains_the_demo_task(tmp_path, caplog, monkeypatch):
    import logging

    from rlcore import cli

    class NoTraining:  # the warning comes before the trainer is built
        status = "completed"

        def __init__(self, *args):
            pass

        def train(self):
            return {}

    monkeypatch.setattr("rlcore.trainer.loop.Trainer", NoTraining)

    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"trainer:\n  max_steps: 0\n  output_dir: {tmp_path}/run\n")
    with caplog.at_level(logging.WARNING):
        code = cli.main(["train", "--config", str(cfg), "trainer.progress=false", "trainer.export_final=false"])
    assert code == 0
    assert "data.train_files is not set: the run trains on the built-in demo task" in caplog.text
