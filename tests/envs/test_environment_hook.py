"""The environment registry: plugins answer rlcore_environment and rlcore_tool_parser; names,
conflicts and settings are checked with errors naming the plugin or key."""

import pytest

from rlcore.envs import ParsedTurn, Step
from rlcore.envs.runner import EpisodeRunner, collect_environments, episode_metrics
from rlcore.errors import EnvError
from rlcore.hookspecs import hookimpl
from rlcore.plugin_manager import build_plugin_manager

from envkit import WordTok


class Counter:
    observation_role = "user"

    def __init__(self, config):
        self.target = int(config.get("target", 2))

    async def start(self, row):
        return None

    async def step(self, turn):
        return Step(observation=str(turn.index + 1), done=turn.index + 1 >= self.target, reward=0.5)


class MyPlugin:
    @hookimpl
    def rlcore_environment(self, register):
        register("counter", Counter)

    @hookimpl
    def rlcore_tool_parser(self, register):
        register("none", lambda text: ParsedTurn(content=text))


def test_plugins_register_environments_and_parsers():
    pm = build_plugin_manager([])
    pm.register(MyPlugin(), "my-envs")
    envs = collect_environments(pm, {"counter": {"target": 3, "max_turns": 5}})
    assert {"python", "guess", "demo_lookup", "counter"} <= set(envs.factories)
    assert envs.factories["counter"][1] == "my-envs" and envs.factories["python"][1] == "defaults"
    assert {"hermes", "none"} <= set(envs.parsers)
    assert envs.limits("counter").max_turns == 5
    assert envs.make("counter").target == 3  # max_turns is the rollout's, not passed on


def test_same_name_from_two_plugins_is_an_error():
    class Clash:
        @hookimpl
        def rlcore_environment(self, register):
            register("python", Counter)

    pm = build_plugin_manager([])
    pm.register(Clash(), "clash")
    with pytest.raises(EnvError, match="'python' is registered by two plugins: 'defaults' and 'clash'"):
        collect_environments(pm)


def test_unknown_environment_and_bad_settings_are_named():
    envs = collect_environments(build_plugin_manager([]), {"python": {"timeot_s": 1}})
    with pytest.raises(EnvError, match="environment 'pyhton' is not registered \\(did you mean 'python'\\?\\)"):
        envs.check_names(["pyhton"], "data.env_key")
    with pytest.raises(EnvError, match="plugin_config.python.timeot_s"):
        envs.make("python")


def test_runner_plays_async_environment_turns():
    pm = build_plugin_manager([])
    pm.register(MyPlugin(), "my-envs")

    runner = EpisodeRunner(collect_environments(pm, {"counter": {"target": 2}}), WordTok())
    try:
        (ep,) = runner.start(["counter"], [{}])
        assert ep.turn_ended([5, 6], 2, 20).result() == [7]  # observation "1" -> one token
        assert ep.turn_ended([5, 1], 5, 20).result() is None  # done after two turns
        assert ep.reward == 1.0 and ep.turns == 2 and ep.model_tokens == 4 and ep.observation_tokens == 1
        assert episode_metrics([ep, None])["env/turns_mean"] == 2.0
    finally:
        runner.close()
