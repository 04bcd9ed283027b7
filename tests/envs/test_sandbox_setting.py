"""``env.python.sandbox``: ``strict`` refuses a run that uses the ``python`` environment on a host
without the strict guards (simulated here), before any model loads, and never shows the model a run
that lacked them; ``best-effort`` runs with what the host gives, logs its guards once and counts
them; ``rlcore validate`` says which level the host gives."""

import asyncio
import json
import logging
import os

import pytest

from rlcore.cli import main
from rlcore.config import load_config
from rlcore.envs import builtin
from rlcore.envs.base import Turn
from rlcore.envs.builtin import PythonToolEnv, with_sandbox_mode
from rlcore.envs.sandbox import SandboxLevel, run_python
from rlcore.errors import EnvError
from rlcore.preflight import preflight

WEAK = SandboxLevel(strict=False, isolation="none", guards=("audit", "seccomp"))
CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'


@pytest.fixture
def weak_host(monkeypatch):
    """A host without namespaces: the level says so, and every run is made without them."""
    monkeypatch.setattr(builtin, "sandbox_level", lambda: WEAK)
    monkeypatch.setattr(builtin, "run_python", lambda code, limits, **kw: run_python(code, limits, isolation="none",
                                                                                     **kw))
    monkeypatch.setattr(builtin, "_logged", type(builtin._logged)())


def data(tmp_path, env):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": "a b c", "env": e, "ground_truth": "42"}) + "\n" for e in env))
    return str(path)


def args(tmp_path, train, *extra):
    return [f"data.train_files=[{train}]", "data.env_key=env", "ppo.rollout_batch_size=2",
            f"trainer.output_dir={tmp_path / 'run'}", *extra]


def test_strict_refuses_a_run_using_the_python_environment_before_any_model_loads(tmp_path, weak_host, capsys):
    train = data(tmp_path, ["guess", "python"])
    with pytest.raises(EnvError) as err:
        preflight(load_config([], args(tmp_path, train)), [])
    text = str(err.value)
    assert f"data.train_files: {train} row 1 (line 2)" in text and "env.python.sandbox" in text
    assert "best-effort" in text and "private_root" in text
    assert main(["train", *args(tmp_path, train)]) != 0
    assert "needs a strict sandbox" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "run" / "_demo"), "the demo model was built before the refusal"


def test_strict_does_not_refuse_a_run_without_the_python_environment(tmp_path, weak_host):
    preflight(load_config([], args(tmp_path, data(tmp_path, ["guess", "guess"]))), [])


def test_best_effort_runs_on_a_weak_host(tmp_path, weak_host):
    preflight(load_config([], args(tmp_path, data(tmp_path, ["python", "python"]), "env.python.sandbox=best-effort")), [])


def step(env, text):
    return asyncio.run(env.step(Turn(text=text, token_ids=(), index=0)))


def test_a_strict_python_environment_does_not_start_on_a_weak_host(weak_host):
    env = PythonToolEnv({"sandbox": "strict"})
    with pytest.raises(EnvError, match="needs a strict sandbox"):
        env.start({"ground_truth": "42"})


def test_a_strict_tool_withholds_the_output_of_a_run_without_the_strict_guards(weak_host):
    env = PythonToolEnv({"sandbox": "strict"})  # started as the level said strict (a host that lost it since)
    out = step(env, CALL)
    assert "42" not in out.observation[0]["content"] and "withheld" in out.observation[0]["content"]
    assert out.metrics["tool_errors"] == 1 and out.metrics["sandbox_weak"] == 1


def test_best_effort_logs_the_guards_once_and_counts_them(weak_host, caplog):
    env = PythonToolEnv({"sandbox": "best-effort"})
    env.start({"ground_truth": "42"})
    with caplog.at_level(logging.WARNING, logger="rlcore.envs.builtin"):
        first, second = step(env, CALL), step(env, CALL)
    assert first.observation[0]["content"] == "42" == second.observation[0]["content"]
    assert first.metrics["sandbox_weak"] == 1 and first.metrics["sandbox_strict"] == 0
    logged = [r.getMessage() for r in caplog.records if "best-effort" in r.getMessage()]
    assert len(logged) == 1 and "audit, seccomp" in logged[0] and "private_root" in logged[0]


def test_a_strict_host_counts_strict_runs():
    from rlcore.envs.sandbox import sandbox_level

    if not sandbox_level().strict:
        pytest.skip(f"this host gives the sandbox {sandbox_level().describe()}")
    env = PythonToolEnv({"sandbox": "strict"})
    env.start({"ground_truth": "42"})
    out = step(env, CALL)
    assert out.observation[0]["content"] == "42" and out.metrics["sandbox_strict"] == 1


def test_the_level_is_set_by_the_env_section_only():
    assert with_sandbox_mode({"python": {"timeout_s": 1}}, "best-effort")["python"] == {
        "timeout_s": 1, "sandbox": "best-effort"}
    with pytest.raises(EnvError, match="plugin_config.python.sandbox: the sandbox level is set by env.python.sandbox"):
        with_sandbox_mode({"python": {"sandbox": "strict"}}, "strict")
    with pytest.raises(ValueError, match="plugin_config.python.sandbox"):
        PythonToolEnv({"sandbox": "lenient"})


def test_validate_reports_the_hosts_level(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("rlcore.envs.sandbox.sandbox_level", lambda: WEAK)
    assert main(["validate", f"trainer.output_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "python tool sandbox on this host: best-effort only (isolation: none; guards: audit, seccomp)" in out
