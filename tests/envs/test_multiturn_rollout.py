"""Multi-turn generation: the engine continues a slot after an observation with its KV cache kept,
gives the same greedy episodes as the turn-by-turn Hugging Face path, and its log-probs line up
with the trainer's teacher-forced ones on model tokens only."""

import threading
import time

import pytest
import torch

from rlcore.demo import LETTERS, TOOL_WORDS, build_model_dir, build_tool_model_dir
from rlcore.envs import Step
from rlcore.envs.runner import EpisodePrompt, EpisodeRunner, Environments, EpisodeLimits, episode_metrics
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.engine import RolloutEngine
from rlcore.rollout.hf import HFGenerateBackend
from rlcore.trainer.experience import batched_logprobs, to_experience
from rlcore.trainer.models import load_causal_lm, load_tokenizer

from envkit import letter_episodes, sampled


class Echo:
    """Answers every turn with a fixed observation after a short, thread-blocking delay."""

    observation_role = "user"
    calls = 0
    lock = threading.Lock()

    def __init__(self, config):
        self.delay = float(config.get("delay", 0.0))

    def start(self, row):
        return None

    def step(self, turn):
        time.sleep(self.delay)
        with Echo.lock:
            Echo.calls += 1
        return Step(observation="e f g", reward=1.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tool_model_dir(str(tmp_path_factory.mktemp("tool-model")))


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_causal_lm(model_dir).eval()


def play(backend, tok, n=5, delay=0.0, max_turns=3, max_new_tokens=24, stop=("a", "b", "c")):
    envs = Environments({"echo": (Echo, "test")}, {"echo": {"delay": delay}},
                        defaults=EpisodeLimits(max_turns=max_turns, timeout_s=30))
    runner = EpisodeRunner(envs, tok, stop=stop)
    rows = [{"env": "echo"} for _ in range(n)]
    episodes = runner.start([r["env"] for r in rows], rows)
    prompts = [EpisodePrompt(tok.convert_tokens_to_ids(list(LETTERS[i:i + 2 + i % 3])), e)
               for i, e in enumerate(episodes)]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, eos_token_ids=(tok.eos_token_id,),
                            pad_token_id=tok.pad_token_id)
    try:
        return backend.generate(prompts, params), episodes
    finally:
        runner.close()


def test_engine_episodes_match_turn_by_turn_generate(model, tok):
    # 5 prompts in 2 slots: a queue
    engine = RolloutEngine(model, max_batch_size=2, max_seq_len=64, kv_cache="static")
    got, eps = play(engine, tok)
    ref, ref_eps = play(HFGenerateBackend(model), tok)
    assert [e.turns for e in eps] == [e.turns for e in ref_eps]
    assert max(e.turns for e in eps) > 1, "the test needs episodes of several turns"
    width = ref.response_ids.shape[1]
    assert got.response_ids.shape[1] == width
    assert torch.equal(got.response_ids, ref.response_ids)
    assert torch.equal(got.response_mask, ref.response_mask) and torch.equal(got.attention, ref.attention)
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=5e-3, rtol=0)  # padding changes fp32 sums
    # observations are context: in the sequence, not in the loss
    obs = tok.convert_tokens_to_ids(["e", "f", "g"])
    row = next(i for i, e in enumerate(eps) if e.turns > 1)
    ids, model_mask, attention = got.response_ids[row].tolist(), got.response_mask[row], got.attention[row]
    start = next(i for i in range(width - 2) if ids[i:i + 3] == obs and model_mask[i] == 0)
    assert model_mask[start:start + 3].tolist() == [0, 0, 0] and attention[start:start + 3].tolist() == [1, 1, 1]
    assert got.logprobs[row, start:start + 3].abs().sum() == 0
    # the history was never prefilled again: one prefill per admission, not per turn
    assert got.stats["rollout/prefill_calls"] <= 5
    metrics = episode_metrics(eps)
    assert metrics["env/turns_mean"] == sum(e.turns for e in eps) / 5
    assert metrics["env/observation_tokens_mean"] > 0


def test_qwen3_observation_tokens_get_the_per_head_q_k_norms(tmp_path):
    """An observation appended to a Qwen3 slot is run through the q/k norms like the prompt was:
    the model tokens after it have the log-probs of the turn-by-turn HF path."""
    qwen3_dir = build_model_dir(str(tmp_path / "qwen3"), arch="qwen3", extra_words=TOOL_WORDS)
    qwen3, qtok = load_causal_lm(qwen3_dir).eval(), load_tokenizer(qwen3_dir)
    got, eps = play(RolloutEngine(qwen3, max_batch_size=2, max_seq_len=64, kv_cache="static"), qtok)
    ref, _ = play(HFGenerateBackend(qwen3), qtok)
    assert max(e.turns for e in eps) > 1, "the test needs episodes of several turns"
    assert torch.equal(got.response_ids, ref.response_ids)
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=1e-4, rtol=0)


class Recorder:
    """Records every turn it is shown; answers after a short delay, so slots ride along paused."""

    observation_role = "user"

    def __init__(self, config):
        self.turns = []

    def start(self, row):
        return None

    def step(self, turn):
        time.sleep(0.02)
        self.turns.append(list(turn.token_ids))
        return Step(observation="a b c")


@pytest.mark.parametrize("backend", ["engine", "hf"])
def test_the_tokens_trained_are_the_tokens_the_environment_saw(model, tok, backend):
    """Sampled episodes that end on the token budget: the model tokens of each row are exactly
    the turns its environment was shown (a slot left riding along after its budget was spent
    used to overwrite its last token)."""
    envs = Environments({"rec": (Recorder, "test")}, {}, defaults=EpisodeLimits(max_turns=4, timeout_s=30))
    runner = EpisodeRunner(envs, tok, stop=())
    n = 12
    episodes, prompts = letter_episodes(runner, tok, "rec", n)
    params = sampled(tok, max_new_tokens=20, seed=1)
    gen = RolloutEngine(model, max_batch_size=16, max_seq_len=48, kv_cache="static") if backend == "engine" \
        else HFGenerateBackend(model)
    try:
        batch = gen.generate(prompts, params)
    finally:
        runner.close()
    at_budget = 0
    for row, episode in enumerate(episodes):
        seen = [t for turn in episode.env.turns for t in turn]
        mask = batch.response_mask[row].tolist()
        trained = [t for t, m in zip(batch.response_ids[row].tolist(), mask) if m]
        assert trained == seen, f"row {row}"
        at_budget += int(batch.response_attention[row].sum()) == params.max_new_tokens
    assert at_budget > 0, "the test needs episodes that end on the budget"


@pytest.mark.parametrize("backend", ["engine", "hf"])
def test_teacher_forced_logprobs_line_up_on_model_tokens(model, tok, backend):
    gen = RolloutEngine(model, max_batch_size=4, max_seq_len=64, kv_cache="static") if backend == "engine" \
        else HFGenerateBackend(model)
    batch, eps = play(gen, tok, n=4)
    assert int((batch.attention - batch.response_mask).sum()) > 0, "no observation tokens in the batch"
    exp = to_experience(batch, torch.zeros(4), torch.device("cpu"))
    forced = batched_logprobs(model, exp.input_ids, exp.attention_mask, exp.response_len, 1.0, 2,
                              exp.response_mask)
    mask = exp.response_mask.bool()
    torch.testing.assert_close(forced[mask], exp.old_logprobs[mask], atol=5e-3, rtol=0)  # fp32 sums differ
    assert torch.equal(exp.attention_mask[:, -batch.response_ids.shape[1]:], batch.attention)
    # with the observations left out of the attention the model tokens after them would not line up
    ids, attn = exp.input_ids.clone(), exp.attention_mask.clone()
    attn[:, -batch.response_ids.shape[1]:] = batch.response_mask
    wrong = batched_logprobs(model, ids, attn, exp.response_len, 1.0, 2, exp.response_mask)
    assert (wrong[mask] - exp.old_logprobs[mask]).abs().max() > 0.05


def test_environment_calls_run_concurrently_while_slots_decode(model, tok):
    Echo.calls = 0
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=64, kv_cache="static")
    start = time.perf_counter()
    batch, eps = play(engine, tok, n=8, delay=0.3, max_turns=2)
    elapsed = time.perf_counter() - start
    calls = Echo.calls
    assert calls >= 8
    # one after the other the calls alone would take calls x 0.3 s
    assert elapsed < 0.3 * calls * 0.6, (elapsed, calls)


def test_a_paged_engine_plays_the_static_engines_episodes(model, tok):
    got, eps = play(RolloutEngine(model, max_batch_size=2, max_seq_len=64), tok)
    want, _ = play(RolloutEngine(model, max_batch_size=2, max_seq_len=64, kv_cache="static"), tok)
    assert max(e.turns for e in eps) > 1, "the test needs episodes of several turns"
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.attention, want.attention)
