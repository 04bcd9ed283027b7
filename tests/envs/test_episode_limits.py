"""An episode's token budget (env.max_tokens, plugin_config.<env>.max_tokens) caps model and
observation tokens together, and an episode ended by it counts as truncated."""

import pytest

from rlcore.demo import build_tool_model_dir
from rlcore.envs import Step
from rlcore.envs.runner import EpisodeLimits, EpisodeRunner, Environments, episode_metrics
from rlcore.errors import EnvError
from rlcore.rollout.hf import HFGenerateBackend
from rlcore.trainer.models import load_causal_lm, load_tokenizer

from envkit import WordTok, letter_episodes, sampled


class Talk:
    """Answers every turn with an observation (never done); records the turns it is shown."""

    observation_role = "user"

    def __init__(self, config):
        self.turns = []
        self.done_at = config.get("done_at")

    def start(self, row):
        return None

    def step(self, turn):
        self.turns.append(turn)
        return Step(observation="a", reward=1.0, done=self.done_at is not None and turn.index + 1 >= self.done_at)


def runner_for(limits, plugin_config=None):
    envs = Environments({"talk": (Talk, "test")}, dict(plugin_config or {}), defaults=limits)
    return EpisodeRunner(envs, WordTok(), stop=())


def test_a_turn_that_reaches_the_budget_ends_the_episode_truncated():
    runner = runner_for(EpisodeLimits(max_turns=4, max_tokens=6, timeout_s=30))
    try:
        (ep,) = runner.start(["talk"], [{}])
        assert ep.token_limit(24) == 6 and ep.token_limit(4) == 4
        # 6 model tokens of a budget of 24 (max_new_tokens): the episode's own limit is reached
        assert ep.turn_ended([5] * 6, 6, 24).result() is None
        assert ep.env.turns[-1].truncated, "the environment is told its last turn was cut"
        assert ep.done and ep.truncated and ep.turns == 1
    finally:
        runner.close()


def test_truncated_frac_counts_episodes_cut_by_the_budget_and_not_those_the_environment_ends():
    runner = runner_for(EpisodeLimits(max_turns=4, timeout_s=30), {"talk": {"done_at": 1}})
    try:
        cut, finished = runner.start(["talk", "talk"], [{}, {}])
        # the backend cut the turn at the budget; the environment answers done (it takes it as the answer)
        assert cut.turn_ended([5, 5, 5], 20, 20, truncated=True).result() is None
        assert finished.turn_ended([5, 1], 2, 20).result() is None  # a whole answer: done
        assert cut.truncated and not finished.truncated
        assert episode_metrics([cut, finished])["env/truncated_frac"] == 0.5
    finally:
        runner.close()


def test_plugin_config_max_tokens_overrides_the_env_section_and_is_checked():
    envs = Environments({"talk": (Talk, "test")}, {"talk": {"max_tokens": 5}},
                        defaults=EpisodeLimits(max_turns=4, max_tokens=10))
    assert envs.limits("talk").max_tokens == 5
    for bad in (0, "8", 2.5):
        envs = Environments({"talk": (Talk, "test")}, {"talk": {"max_tokens": bad}})
        with pytest.raises(EnvError, match="plugin_config.talk.max_tokens"):
            envs.limits("talk")


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    path = build_tool_model_dir(str(tmp_path_factory.mktemp("tool-model")))
    return load_causal_lm(path).eval(), load_tokenizer(path)


@pytest.mark.parametrize("backend", ["hf", "engine"])
@pytest.mark.parametrize("source", ["env", "plugin_config"])
def test_backends_stop_model_tokens_at_the_episode_budget(tool_model, source, backend):
    from rlcore.rollout.engine import RolloutEngine

    model, tok = tool_model
    limits = EpisodeLimits(max_turns=4, max_tokens=6 if source == "env" else None, timeout_s=30)
    envs = Environments({"talk": (Talk, "test")}, {"talk": {"max_tokens": 6}} if source == "plugin_config" else {},
                        defaults=limits)
    runner = EpisodeRunner(envs, tok, stop=())
    n = 8
    episodes, prompts = letter_episodes(runner, tok, "talk", n)
    params = sampled(tok, max_new_tokens=24, seed=3)
    try:
        gen = HFGenerateBackend(model) if backend == "hf" else \
            RolloutEngine(model, max_batch_size=8, max_seq_len=48, kv_cache="static")
        batch = gen.generate(prompts, params)
    finally:
        runner.close()
    assert int(batch.response_attention.sum(-1).max()) <= 6
    for row, ep in enumerate(episodes):
        seen = [t for turn in ep.env.turns for t in turn.token_ids]
        trained = [t for t, m in zip(batch.response_ids[row].tolist(), batch.response_mask[row].tolist()) if m]
        assert trained == seen and len(seen) <= 6, f"row {row}"
        assert ep.done and ep.truncated, f"row {row}: the environment never ends it, the budget does"
    assert episode_metrics(episodes)["env/truncated_frac"] == 1.0
