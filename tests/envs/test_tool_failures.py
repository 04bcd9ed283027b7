"""Tool calls: arguments a tool does not take are told apart from errors the tool raises, and an
episode's end (its environment's close()) reaches a tool still working in a thread."""

import asyncio
import threading
import time

from rlcore.envs import Step, ToolEnvironment, Turn, parse_hermes
from rlcore.envs.runner import EpisodeLimits, EpisodeRunner, Environments

from envkit import WordTok


class Calc(ToolEnvironment):
    def __init__(self, config=None):
        super().__init__()
        self.calls = 0
        self.tools = {"div": self.div}

    def div(self, a, b=1):
        self.calls += 1
        if not isinstance(a, (int, float)):
            raise TypeError(f"a must be a number, not {type(a).__name__}")
        return str(a / b)

    def score(self, answer):
        return 0.0


def call(env, arguments):
    import json

    text = "<tool_call>" + json.dumps({"name": "div", "arguments": arguments}) + "</tool_call>"
    return asyncio.run(env.step(Turn(text=text, token_ids=(), index=0)))


def test_a_type_error_raised_inside_a_tool_is_a_tool_failure_not_bad_arguments():
    env = Calc()
    out = call(env, {"a": "six", "b": 2})
    text = out.observation[0]["content"]
    assert text == "error: div failed: TypeError: a must be a number, not str"
    assert out.metrics["tool_errors"] == 1 and env.calls == 1
    out = call(env, {"a": 1, "b": 0})
    assert out.observation[0]["content"].startswith("error: div failed: ZeroDivisionError")


def test_arguments_the_tool_does_not_take_are_bad_arguments_and_the_tool_is_not_called():
    env = Calc()
    for arguments, why in (({"b": 2}, "missing a required argument: 'a'"),
                           ({"a": 1, "c": 2}, "got an unexpected keyword argument 'c'")):
        out = call(env, arguments)
        assert out.observation[0]["content"] == f"error: bad arguments for div: {why}"
        assert out.metrics["tool_errors"] == 1
    assert env.calls == 0
    assert call(env, {"a": 6, "b": 3}).observation[0]["content"] == "2.0"


class Slow(ToolEnvironment):
    """A tool that works in a thread until the episode closes (as a sandbox run should)."""

    stopped_after: list = []

    def __init__(self, config=None):
        super().__init__()
        self.tools = {"work": self.work}

    async def work(self):
        def run():
            begin = time.perf_counter()
            self.closed.wait(20.0)
            Slow.stopped_after.append(time.perf_counter() - begin)
            return "finished"

        return await asyncio.to_thread(run)

    def score(self, answer):
        return 0.0


class Tok(WordTok):
    """Token 9 is a call of the ``work`` tool; any other turn reads as an answer."""

    def decode(self, ids, skip_special_tokens=True):
        return "<tool_call>{\"name\": \"work\", \"arguments\": {}}</tool_call>" if ids == [9] else "answer"


def test_env_timeout_closes_the_episode_and_stops_the_tool_thread():
    Slow.stopped_after = []
    envs = Environments({"slow": (Slow, "test")}, {}, {"hermes": parse_hermes},
                        defaults=EpisodeLimits(max_turns=4, timeout_s=0.3))
    runner = EpisodeRunner(envs, Tok(), stop=())
    try:
        (ep,) = runner.start(["slow"], [{}])
        begin = time.perf_counter()
        assert ep.turn_ended([9], 1, 50).result(timeout=10) is None
        assert ep.timed_out and ep.env.closed.is_set()
        deadline = time.perf_counter() + 5
        while not Slow.stopped_after and time.perf_counter() < deadline:
            time.sleep(0.01)
        assert Slow.stopped_after and Slow.stopped_after[0] < 3.0, "the tool's thread ran on after the timeout"
        assert time.perf_counter() - begin < 5.0
    finally:
        runner.close()


class Closing:
    observation_role = "user"

    def __init__(self, config):
        self.closes = 0
        self.done_at = int(config.get("done_at", 99))

    def start(self, row):
        return None

    def step(self, turn):
        return Step(observation="a", done=turn.index + 1 >= self.done_at)

    def close(self):
        self.closes += 1


def test_close_is_called_once_when_an_episode_ends_by_done_or_by_a_limit():
    envs = Environments({"c": (Closing, "test"), "d": (Closing, "test")}, {"d": {"done_at": 1}},
                        defaults=EpisodeLimits(max_turns=2, timeout_s=30))
    runner = EpisodeRunner(envs, Tok(), stop=())
    try:
        by_turns, by_done, by_budget = runner.start(["c", "d", "c"], [{}, {}, {}])
        assert by_turns.turn_ended([5], 1, 50).result() == [7] and by_turns.env.closes == 0
        assert by_turns.turn_ended([5], 3, 50).result() is None  # max_turns
        assert by_done.turn_ended([5], 1, 50).result() is None  # the environment is done
        assert by_budget.turn_ended([5], 50, 50, truncated=True).result() is None  # the token budget
        assert [e.env.closes for e in (by_turns, by_done, by_budget)] == [1, 1, 1]
        assert by_turns.truncated and not by_done.truncated and by_budget.truncated
    finally:
        runner.close()


def test_a_thread_tool_sees_closed_unset_while_the_episode_runs():
    env = Slow()
    assert isinstance(env.closed, threading.Event) and not env.closed.is_set()
    asyncio.run(env.close())
    assert env.closed.is_set()
