"""Environment names before a model loads: the data's env column is checked by validate and train
(naming the env, the file, the first row and the plugin to select), plugin_config sections of
environments do not warn, and `rlcore plugins` says which environments need --plugins."""

import json
import logging
import os
import textwrap

import pytest

from rlcore.cli import main
from rlcore.config import load_config
from rlcore.errors import EnvError
from rlcore.plugin_manager import BUILTIN_MODULES, build_plugin_manager
from rlcore.preflight import preflight

PLUGIN = textwrap.dedent('''
    from rlcore.envs import Step
    from rlcore.hookspecs import hookimpl


    class Countdown:
        def __init__(self, config):
            self.penalty = float(config.get("penalty", 0.0))

        def start(self, row):
            return None

        def step(self, turn):
            return Step(reward=1.0, done=True)


    @hookimpl
    def rlcore_environment(register):
        register("countdown", Countdown)
''')


@pytest.fixture
def my_envs(tmp_path, monkeypatch):
    """An installed plugin 'my-envs' (not selected unless asked for) registering 'countdown'."""
    (tmp_path / "rlcore_test_my_envs.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BUILTIN_MODULES, "my-envs", "rlcore_test_my_envs")
    return "my-envs"


def write_jsonl(path, envs):
    path.write_text("".join(json.dumps({"prompt": "a b c", "env": e}) + "\n" for e in envs))
    return str(path)


def config(tmp_path, train, *extra):
    # best-effort: the names are checked on any host (test_sandbox_setting.py checks the strict refusal)
    return load_config([], [f"data.train_files=[{train}]", "data.env_key=env", "ppo.rollout_batch_size=2",
                            f"trainer.output_dir={tmp_path / 'run'}", "env.python.sandbox=best-effort", *extra])


def test_an_unknown_environment_in_the_data_is_named_with_its_file_and_first_row(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ["python", None, "", "pyhton", "python", "pyhton"])
    with pytest.raises(EnvError) as err:
        preflight(config(tmp_path, train), [])
    text = str(err.value)
    assert f"data.train_files: {train} row 3 (line 4) names environment 'pyhton'" in text
    assert "did you mean 'python'?" in text and text.count("names environment") == 1  # once per name


def test_parquet_files_are_read_by_their_env_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    ok = write_jsonl(tmp_path / "ok.jsonl", ["guess", "guess"])
    val = str(tmp_path / "val.parquet")
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "env": ["guess", None, "nowhere"]}), val)
    with pytest.raises(EnvError, match=f"data.val_files: {val} row 2 names environment 'nowhere'"):
        preflight(config(tmp_path, ok, f"data.val_files=[{val}]"), [])
    pq.write_table(pa.table({"prompt": ["a", "b"], "env": ["guess", "python"]}), val)
    preflight(config(tmp_path, ok, f"data.val_files=[{val}]"), [])


def test_validate_names_the_plugin_to_select_before_any_model_loads(tmp_path, my_envs, capsys, caplog):
    train = write_jsonl(tmp_path / "train.jsonl", ["python", "countdown"])
    args = ["validate", f"data.train_files=[{train}]", "data.env_key=env", "ppo.rollout_batch_size=2",
            f"trainer.output_dir={tmp_path / 'run'}", "plugin_config.countdown.penalty=0.5",
            "env.python.sandbox=best-effort"]
    assert main(args) != 0
    err = capsys.readouterr().err
    assert f"{train} row 1 (line 2) names environment 'countdown'" in err
    assert "the installed plugin 'my-envs' registers it: select it with --plugins my-envs" in err
    assert not os.path.exists(tmp_path / "run" / "_demo"), "the demo model was built before the check"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlcore.plugin_manager"):
        assert main(args + ["--plugins", "my-envs"]) == 0
    assert "config OK" in capsys.readouterr().out
    assert not [r for r in caplog.records if "has no effect" in r.getMessage()], \
        "an environment's settings are not an unused plugin section"


def test_only_truly_unused_plugin_config_sections_warn_and_only_once(caplog):
    pm = build_plugin_manager([])
    given = {"python": {"timeout_s": 1}, "guess": {"low": 2}, "nosuch": {"x": 1}}
    with caplog.at_level(logging.WARNING, logger="rlcore.plugin_manager"):
        pm.configure(given)
        pm.configure(given)  # train configures again after the start-up checks
    warnings = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("plugin_config.nosuch has no effect")


def test_plugins_listing_says_which_environments_need_plugins(my_envs, capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.split("environments (", 1)[1].splitlines()[1:] if line.strip()}
    assert "from plugin my-envs (needs --plugins my-envs)" in lines["countdown"]
    assert "from plugin defaults (built in, always available)" in lines["python"]
