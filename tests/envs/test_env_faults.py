"""Faults of environments: a call that never returns (step, start) is bounded by env.timeout_s and
never keeps the process alive; a malformed Step is an error naming the environment (exit 2 from
``rlcore train``); a huge observation is cut before it is tokenized."""

import json
import os
import subprocess
import sys
import time

import pytest

from rlcore.envs import Step
from rlcore.envs.runner import EpisodeLimits, EpisodeRunner, Environments
from rlcore.errors import EXIT_ERROR, EnvError

from envkit import WordTok

HERE = os.path.dirname(os.path.abspath(__file__))

#: An environment whose ``start`` or ``step`` (argv[1]) blocks for good, played in a process of its own.
STUCK = r"""
import sys, threading
from rlcore.envs import Step
from rlcore.envs.runner import EpisodeLimits, EpisodeRunner, Environments
from rlcore.errors import EnvError
from envkit import WordTok

where = sys.argv[1]

class Stuck:
    def start(self, row):
        if where == "start":
            threading.Event().wait()
        return None

    def step(self, turn):
        threading.Event().wait()

envs = Environments({"stuck": (lambda cfg: Stuck(), "test")}, {}, defaults=EpisodeLimits(timeout_s=0.5))
runner = EpisodeRunner(envs, WordTok(), stop=())
try:
    (ep,) = runner.start(["stuck"], [{}])
    print("answer", ep.turn_ended([5, 1], 2, 16).result(timeout=30), ep.timed_out, flush=True)
except EnvError as e:
    print("error", e, flush=True)
"""


def _stuck(tmp_path, where: str) -> subprocess.CompletedProcess:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(script), where], capture_output=True, text=True, timeout=60, env=env)


def test_a_step_that_never_returns_times_out_and_the_process_still_exits(tmp_path):
    t0 = time.monotonic()
    proc = _stuck(tmp_path, "step")  # before the fix: the interpreter waited for the blocked worker at exit
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "answer None True" in proc.stdout
    assert time.monotonic() - t0 < 30


def test_a_start_that_never_returns_is_an_error_naming_the_environment(tmp_path):
    proc = _stuck(tmp_path, "start")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "error environment 'stuck' took over 0.5 s (env.timeout_s) to start an episode" in proc.stdout


class Answers:
    """Answers every turn with the Step given in its config."""

    observation_role = "user"

    def __init__(self, config):
        self.step_value = config["step"]

    def start(self, row):
        return None

    def step(self, turn):
        return self.step_value


def _play(step: Step, limits: EpisodeLimits = EpisodeLimits(timeout_s=30)):
    envs = Environments({"answers": (Answers, "test")}, {"answers": {"step": step}}, defaults=limits)
    runner = EpisodeRunner(envs, WordTok(), stop=())
    try:
        (ep,) = runner.start(["answers"], [{}])
        return ep, ep.turn_ended([5, 1], 2, 10_000).result(timeout=30)
    finally:
        runner.close()


@pytest.mark.parametrize("step, what", [
    (Step(observation=42), "the observation is int"),
    (Step(observation=[{"role": "user"}]), "message 0 has no text 'content'"),
    (Step(observation=[{"role": "user", "content": "ok"}, "bare"]), "message 1 is str"),
    (Step(observation="ok", reward="abc"), "the reward is str"),
    (Step(observation="ok", reward=float("nan")), "the reward is float"),
    (Step(observation="ok", metrics={"calls": "x"}), "metric 'calls' is str"),
])
def test_a_malformed_step_is_an_error_naming_the_environment(step, what):
    with pytest.raises(EnvError, match=rf"environment 'answers' returned a malformed answer from step\(\) on "
                                       rf"turn 0: {what}"):
        _play(step)


class Opens(Answers):
    def start(self, row):
        return self.step_value


@pytest.mark.parametrize("messages, what", [("hello", "the initial messages are str"),
                                            ({"role": "user", "content": "hi"}, "the initial messages are dict"),
                                            ([{"role": "user", "content": None}], "message 0 has no text 'content'")])
def test_malformed_initial_messages_are_an_error_naming_the_environment(messages, what):
    envs = Environments({"opens": (Opens, "test")}, {"opens": {"step": messages}}, defaults=EpisodeLimits(timeout_s=30))
    runner = EpisodeRunner(envs, WordTok(), stop=())
    try:
        with pytest.raises(EnvError, match=rf"environment 'opens' returned malformed initial messages from start\(\): "
                                           rf"{what}"):
            runner.start(["opens"], [{}])
    finally:
        runner.close()


def test_a_huge_observation_is_cut_before_it_is_tokenized():
    limits = EpisodeLimits(timeout_s=30, max_observation_chars=100)
    t0 = time.monotonic()
    ep, ids = _play(Step(observation="word " * 4_000_000), limits)  # 20 MB
    assert time.monotonic() - t0 < 10
    assert 20 <= len(ids) <= 30  # WordTok: a token a word; 20 words of "word " kept, and the note of the cut
    assert ep.metrics["observations_cut"] == 1.0
    ep, ids = _play(Step(observation=[{"role": "tool", "content": "a " * 30}, {"role": "tool", "content": "b " * 80}]),
                    limits)
    assert len(ids) <= 60 and ep.metrics["observations_cut"] == 1.0
    ep, ids = _play(Step(observation="short"), limits)
    assert ids == [7] and "observations_cut" not in ep.metrics


@pytest.mark.slow
def test_rlcore_train_exits_2_naming_the_environment_of_a_malformed_step(tmp_path, monkeypatch, capsys):
    from rlcore.cli import main
    from rlcore.envs import builtin

    monkeypatch.setattr(builtin.GuessEnv, "step", lambda self, turn: Step(observation=42))
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": "a b c", "env": "guess", "secret": 50}) + "\n" for _ in range(4)))
    code = main(["train", f"data.train_files=[{train}]", "data.env_key=env", "actor.rollout_backend=engine",
                 "algorithm.adv_estimator=grpo", "ppo.rollout_batch_size=2", "ppo.generation.n=2",
                 "ppo.mini_batch_size=4", "ppo.generation.max_new_tokens=8", "data.max_prompt_length=8",
                 "env.stop=[]", "trainer.max_steps=1", "trainer.eval_samples=0", "trainer.export_final=false",
                 f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress=false", "trainer.gpu_monitor=false"])
    assert code == EXIT_ERROR
    assert "environment 'guess' returned a malformed answer from step()" in capsys.readouterr().err
