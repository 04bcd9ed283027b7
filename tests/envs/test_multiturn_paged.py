"""Multi-turn episodes on the paged KV cache: the same episodes as the static cache (greedy and
sampled, at a fixed seed), observations appended in one batched forward without re-prefill, a
paused episode giving up its batch row, the token budget's edges, and the trainer building a
paged engine for ``data.env_key``."""

import time

import pytest
import torch

from rlcore.demo import LETTERS, build_tool_model_dir
from rlcore.envs import Step
from rlcore.envs.runner import EpisodeLimits, EpisodePrompt, EpisodeRunner, Environments
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.engine import RolloutEngine
from rlcore.trainer.models import load_causal_lm, load_tokenizer


class Tool:
    """Answers every turn with ``obs`` after ``delay`` seconds (varied per call, so answers arrive
    in another order than the turns ended)."""

    observation_role = "user"

    def __init__(self, config):
        self.delay, self.obs = float(config.get("delay", 0.0)), config.get("obs", "e f g")
        self.calls = 0

    def start(self, row):
        return None

    def step(self, turn):
        self.calls += 1
        time.sleep(self.delay * (1 + (len(turn.token_ids) + self.calls) % 3))
        return Step(observation=self.obs, reward=1.0)


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    path = build_tool_model_dir(str(tmp_path_factory.mktemp("tool-model")))
    return load_tokenizer(path), load_causal_lm(path).eval()


def play(engine, tok, n=7, max_new_tokens=24, temperature=0.0, seed=3, delay=0.01, obs="e f g", max_turns=3):
    envs = Environments({"tool": (Tool, "test")}, {"tool": {"delay": delay, "obs": obs}},
                        defaults=EpisodeLimits(max_turns=max_turns, timeout_s=30))
    runner = EpisodeRunner(envs, tok, stop=("a", "b", "c"))
    episodes = runner.start(["tool"] * n, [{}] * n)
    prompts = [EpisodePrompt(tok.convert_tokens_to_ids(list(LETTERS[i % 8:i % 8 + 2 + i % 3])), e)
               for i, e in enumerate(episodes)]
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                            eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id)
    try:
        return engine.generate(prompts, params), episodes
    finally:
        runner.close()


def engines(model, **kwargs):
    kwargs = {"max_batch_size": 3, "max_seq_len": 64, **kwargs}
    return (RolloutEngine(model, kv_cache="static", **kwargs),
            RolloutEngine(model, kv_cache="paged", page_size=16, **kwargs))


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_paged_episodes_are_the_static_caches_episodes(tok_model, temperature):
    """7 episodes through 3 rows, environments answering out of order: the same tokens, masks and
    log-probs with either cache; the observations were appended (one extend token per observation
    token plus the turn's last token) and the history never prefilled again."""
    tok, model = tok_model
    static, paged = engines(model)
    want, want_eps = play(static, tok, temperature=temperature)
    got, eps = play(paged, tok, temperature=temperature)
    assert [e.turns for e in eps] == [e.turns for e in want_eps]
    assert max(e.turns for e in eps) > 1, "the test needs episodes of several turns"
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.response_mask, want.response_mask) and torch.equal(got.attention, want.attention)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    stats = got.stats
    observed = stats["rollout/observation_tokens"]
    assert observed > 0 and stats["rollout/resumed"] > 0
    assert stats["rollout/extend_tokens"] == observed + stats["rollout/resumed"]
    assert stats["rollout/extend_calls"] <= stats["rollout/resumed"]
    assert stats["rollout/prefill_tokens"] <= 7 * 4  # the prompts (at most 4 tokens) only, once each
    assert paged.pool.used == 0  # every page back, parked episodes' included


def test_sampled_episodes_do_not_depend_on_when_environments_answer(tok_model):
    """Draws are keyed by (request, response column): slower environments (other rows, other steps
    at each resume) give the same sampled episodes."""
    tok, model = tok_model
    fast, _ = play(engines(model)[1], tok, temperature=1.0, delay=0.0)
    slow, _ = play(engines(model)[1], tok, temperature=1.0, delay=0.03)
    assert torch.equal(fast.response_ids, slow.response_ids)
    torch.testing.assert_close(fast.logprobs, slow.logprobs, atol=1e-5, rtol=0)


def test_a_paused_episode_gives_up_its_batch_row(tok_model):
    """With pages, episodes waiting on their environment leave the decode batch: more episodes are
    with their environments at once than there are rows, and every step decodes live rows only.
    The static cache keeps a paused episode in its row (riding along)."""
    tok, model = tok_model
    static, paged = engines(model, max_batch_size=2, kv_pages=40)
    got, _ = play(paged, tok, n=8, delay=0.3)
    assert got.stats["rollout/in_flight_peak"] > 2  # a paused episode's row went to a waiting request
    assert got.stats["rollout/batch_occupancy"] == 1.0
    want, _ = play(static, tok, n=8, delay=0.3)
    assert want.stats["rollout/in_flight_peak"] <= 2
    assert want.stats["rollout/batch_occupancy"] < 1.0


def test_batched_extend_equals_one_row_at_a_time(tok_model):
    """Ragged appends to three rows in one forward: the logits and the cache of appending each row
    on its own, with either cache."""
    _, model = tok_model
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    appends = [[15, 16, 2, 3], [4], [17, 6]]
    for kind in ("static", "paged"):
        one, many = (RolloutEngine(model, max_batch_size=3, max_seq_len=64, kv_cache=kind, page_size=16)
                     for _ in range(2))
        for engine in (one, many):
            engine._prefill([0, 1, 2], prompts, 0)
        columns, positions, lows = [5, 5, 5], [3, 2, 5], [2, 3, 0]
        together = many._extend([0, 1, 2], appends, columns, positions, lows)
        alone = torch.cat([one._extend([i], [appends[i]], [columns[i]], [positions[i]], [lows[i]])
                           for i in range(3)])
        torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
        assert torch.equal(many.state.cache_index[:3], torch.tensor([9, 6, 7]))
        assert torch.equal(many.state.positions[:3], torch.tensor([7, 3, 7]))
        torch.testing.assert_close(many.cache, one.cache, atol=1e-5, rtol=1e-5)
        assert many.counters["extend_calls"] == 1 and one.counters["extend_calls"] == 3
        assert many.counters["extend_tokens"] == 7
        valid = (many.state.bias[:3] == 0).tolist()
        assert [sum(row) for row in valid] == [7, 3, 7] and valid[0][2] and not valid[0][1]


@pytest.mark.parametrize("max_new_tokens", [5, 8, 11])
def test_the_token_budget_edges(tok_model, max_new_tokens):
    """Budgets the observation (three tokens and the turn's last) may or may not fit into: the
    responses stay within the budget, both caches agree, and no page is left taken."""
    tok, model = tok_model
    static, paged = engines(model, max_seq_len=32)
    want, _ = play(static, tok, max_new_tokens=max_new_tokens, temperature=1.0)
    got, _ = play(paged, tok, max_new_tokens=max_new_tokens, temperature=1.0)
    assert int(got.attention.sum(-1).max()) <= max_new_tokens
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.attention, want.attention)
    assert paged.pool.used == 0


def test_page_reservation_admits_only_what_can_finish(tok_model):
    """A pool for two sequences at their budget: episodes queue for pages instead of being
    preempted after talking to their environments, and all of them finish."""
    tok, model = tok_model
    engine = RolloutEngine(model, max_batch_size=4, max_seq_len=64, page_size=16, kv_pages=12)
    got, eps = play(engine, tok, n=6)
    assert got.stats["rollout/preemptions"] == 0
    assert all(e.turns >= 1 for e in eps) and engine.pool.used == 0
    assert got.stats["rollout/kv_pages_peak"] <= 11


def test_the_trainer_builds_a_paged_engine_for_episodes():
    from rlcore.config import load_config
    from rlcore.trainer.components import obj, rollout_request

    cfg = load_config([], ["data.env_key=env"])
    request = rollout_request(obj(cfg.actor), obj(cfg.data), obj(cfg.ppo))
    assert request.engine["kv_cache"] == "paged"


@pytest.mark.parametrize("lag", [0, 3], ids=["read-at-once", "read-3-polls-late"])
@pytest.mark.parametrize("kind", ["static", "paged"])
def test_lagged_turn_ends_give_the_same_episodes(tok_model, monkeypatch, kind, lag):
    """Turn ends read from a snapshot without waiting for the device (``lagged_turn_ends``), even a
    snapshot the loop finds ready only a few steps later: the same sampled episodes (tokens, masks,
    log-probs) as reading the flags at each check, with fewer reads that wait."""
    from rlcore.rollout.engine import turns

    tok, model = tok_model
    ready = turns._Snapshot.ready
    polls: dict[int, int] = {}

    def late(snapshot):
        polls[id(snapshot)] = polls.get(id(snapshot), 0) + 1
        return polls[id(snapshot)] > lag and ready(snapshot)

    monkeypatch.setattr(turns._Snapshot, "ready", late)
    plain = engines(model, eos_check_interval=2, lagged_turn_ends=False)[kind == "paged"]
    lagged = engines(model, eos_check_interval=2, lagged_turn_ends=True)[kind == "paged"]
    want, want_eps = play(plain, tok, temperature=1.0, max_new_tokens=32)
    got, eps = play(lagged, tok, temperature=1.0, max_new_tokens=32)
    assert max(e.turns for e in eps) > 1, "the test needs episodes of several turns"
    assert [e.turns for e in eps] == [e.turns for e in want_eps]
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.response_mask, want.response_mask) and torch.equal(got.attention, want.attention)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
    assert got.stats["rollout/host_syncs"] < want.stats["rollout/host_syncs"]
    if lag:
        assert got.stats["rollout/decode_steps"] >= want.stats["rollout/decode_steps"]  # turns ended later


@pytest.mark.skipif(not __import__("rlcore.kernels.decode_attention", fromlist=["x"]).available(
    "cuda" if torch.cuda.is_available() else "cpu"), reason="needs Triton and CUDA or TRITON_INTERPRET=1")
def test_episodes_with_the_extend_as_captured_are_the_static_caches(tok_model):
    """The Triton engine's extends through the padded forward a CUDA graph holds (run without capture
    here) give the static cache's sampled episodes."""
    from rlcore.rollout.engine import extend

    tok, model = tok_model
    static, paged = engines(model, attention="triton", compile=False, attention_tuning={"block_n": 16})
    paged._extend_graphs = extend.ExtendGraphs(paged, capture=False)
    want, _ = play(static, tok, temperature=1.0)
    got, _ = play(paged, tok, temperature=1.0)
    assert got.stats["rollout/extend_graph_calls"] == got.stats["rollout/extend_calls"] > 0
    assert torch.equal(got.response_ids, want.response_ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=0)


def test_a_snapshot_taken_before_a_pause_is_not_read_into_the_next_turn():
    """A slot paused and resumed after a lagged snapshot was taken may come back with the same request
    and the same birth step (the observation's tokens making up for the steps it waited): its turn
    start changed, so the snapshot's stale flag and tokens are not taken for the new turn's end."""
    from types import SimpleNamespace

    from rlcore.rollout.engine.turns import TurnScheduler

    sched = object.__new__(TurnScheduler)
    snap = SimpleNamespace(n=1, steps=10, reqs=[0], born=[4], turns=[0], flags=torch.tensor([True]),
                           tokens=torch.tensor([[5, 6, 2, 9, 9, 9, 9]]), ready=lambda: True)
    sched.__dict__.update(lagged=True, snapshot=snap, live=[0], slot_req=[0], born=[4], steps=12, due=1 << 30,
                          paused={}, stop_texts=[], seen={},
                          eng=SimpleNamespace(eos_check_interval=2, device=torch.device("cpu")),
                          turn_start=[4], out_tokens=torch.zeros(1, 7, dtype=torch.long),
                          done=torch.zeros(1, dtype=torch.bool))
    assert sched._finished_lagged(1) == [] and sched.seen == {}  # resumed since: another turn
    sched.turn_start = [0]
    sched.snapshot = snap
    assert sched._finished_lagged(1) == [0] and 0 in sched.seen  # the same turn: its end is found


def test_compaction_with_paused_rows_keeps_the_budget_step_and_length(tok_model, monkeypatch):
    """Static cache: when the live rows are compacted while episodes wait in their rows, the step at
    which a decoding slot reaches its budget and the attended length are derived from the rows as
    they are after the move (derived before it, a slot could decode past its budget and overwrite its
    last token, depending on when environments answered)."""
    from rlcore.rollout.engine import turns

    tok, model = tok_model
    compact = turns.TurnScheduler._maybe_compact
    seen = {"moves": 0}

    def checked(self):
        live = list(self.live)
        compact(self)
        if self.live != live and any(p.row is not None for p in self.paused.values()):
            seen["moves"] += 1
            kept = (self.due, self.max_col0)
            self._relive()
            assert (self.due, self.max_col0) == kept

    monkeypatch.setattr(turns.TurnScheduler, "_maybe_compact", checked)
    # whether a compaction meets an episode waiting in its row depends on when the environments answer:
    # several answer delays and seeds, until one did (a loaded machine shifts the timing)
    for seed in (3, 5, 7):
        for delay in (0.0, 0.004, 0.01, 0.03, 0.06):
            engine = engines(model, eos_check_interval=2, lagged_turn_ends=False)[0]
            play(engine, tok, temperature=1.0, max_new_tokens=32, delay=delay, seed=seed)
        if seen["moves"]:
            break
    assert seen["moves"] > 0, "the test needs compactions while episodes wait in their rows"


def test_lagged_turn_ends_keep_the_host_within_a_check_interval_of_the_device(tok_model, monkeypatch):
    """With lagged turn ends the host waits for the decode step ``eos_check_interval`` steps back (an
    event a step on CUDA; a stand-in here): never more steps in flight than that, the oldest waited
    for, and the same episodes."""
    from rlcore.rollout.engine import turns

    tok, model = tok_model
    waited, most = [], []

    class Event:
        def record(self):
            most.append(None)

        def synchronize(self):
            waited.append(self)

    init = turns.TurnScheduler.__init__

    def with_events(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.step_event = Event
        original = self._launched

        def launched():
            original()
            most[-1] = len(self.in_flight)
        self._launched = launched

    want, _ = play(engines(model, eos_check_interval=3)[1], tok, temperature=1.0, max_new_tokens=32)
    monkeypatch.setattr(turns.TurnScheduler, "__init__", with_events)
    got, _ = play(engines(model, eos_check_interval=3)[1], tok, temperature=1.0, max_new_tokens=32)
    steps = got.stats["rollout/decode_steps"]
    assert len(most) == steps and max(most) == 3
    assert len(waited) == steps - 3
    assert torch.equal(got.response_ids, want.response_ids)
