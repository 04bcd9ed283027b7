"""Test kit for plugin authors, loaded by pytest through the ``pytest11`` entry point.

Fixtures:

* ``rlcore_pm`` — a fresh plugin manager with the built-in defaults registered.
* ``rlcore_register`` — ``rlcore_register(plugin, name=None)`` registers a plugin for one test only,
  as an entry point would: a class is instantiated (one instance, which it returns), a module or an
  instance is registered as it is.
* ``tiny_model_dir`` — a tiny causal LM and its tokenizer, built on the spot (no download), saved as a
  Hugging Face directory; shared by the whole test session.
* ``tiny_tokenizer`` — the tokenizer of ``tiny_model_dir`` loaded as the trainer loads it
  (:func:`rlcore.trainer.models.load_tokenizer`, through ``from_pretrained``).

Helpers usable outside pytest: :func:`make_tiny_model_dir`, :func:`demo_overrides`, :func:`run_cli`,
:func:`teacher_forced_logprobs`, and :func:`check_rollout_backend`, the conformance suite any
rollout backend plugin can run on itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Any, Callable, Iterator, Optional, Sequence

import pytest


def make_tiny_model_dir(path: str, *, arch: str = "qwen2", hidden_size: int = 64, layers: int = 2,
                        seed: int = 0) -> str:
    """Build a tiny ``arch`` (qwen2 | qwen3 | llama | mistral) model plus tokenizer in ``path``; return ``path``.
    The tokenizer loads back as saved through :func:`rlcore.trainer.models.load_tokenizer`
    (``decode(encode("c k a f")) == "c k a f"`` for every ``arch``)."""
    from rlcore.demo import build_model_dir

    return build_model_dir(path, hidden_size=hidden_size, layers=layers, seed=seed, arch=arch)


def demo_overrides(output_dir: str, *overrides: str) -> list[str]:
    """The overrides of the demo run in ``output_dir`` through the Python API, as ``rlcore train`` runs it:
    the demo preset, ``trainer.output_dir`` and the demo's model as ``actor.model_path`` (built once in
    ``<output_dir>/_demo``, :func:`rlcore.demo.demo_model`), then ``overrides`` (which win), e.g.
    ``Trainer(load_config([], demo_overrides(tmp_path, "trainer.max_steps=2")), pm, DistInfo())``."""
    from rlcore.demo import DEMO_OVERRIDES, demo_model
    from rlcore.protocols import DistInfo

    return [*DEMO_OVERRIDES, f"trainer.output_dir={output_dir}",
            f"actor.model_path={demo_model(str(output_dir), DistInfo())}", *overrides]


def train_demo(output_dir: str, *overrides: str) -> tuple[Any, dict[int, dict[str, float]], list[Any]]:
    """Train the demo run in ``output_dir`` (:func:`demo_overrides`, then ``overrides``) through the
    Python API; return the trainer, each step's metrics as ``rlcore_step_end`` saw them, and the rollout
    backends the run used (recorded at the first step's end: the run closes them when it ends)."""
    from rlcore.config import load_config
    from rlcore.hookspecs import hookimpl
    from rlcore.plugin_manager import build_plugin_manager
    from rlcore.protocols import DistInfo
    from rlcore.trainer.loop import Trainer

    steps: dict[int, dict[str, float]] = {}
    backends: list[Any] = []

    class StepRecorder:
        @hookimpl
        def rlcore_step_end(self, step: int, metrics: dict[str, float]) -> None:
            steps[step] = dict(metrics)
            if not backends:
                backends.extend(trainer.c.generation.backends.values())

    pm = build_plugin_manager([])
    pm.register(StepRecorder())
    trainer = Trainer(load_config([], demo_overrides(output_dir, *overrides)), pm, DistInfo())
    trainer.train()
    return trainer, steps, backends


def run_cli(argv: Sequence[str]) -> tuple[int, str, str]:
    """Run ``rlcore`` in this process; return ``(exit_code, stdout, stderr)``."""
    from rlcore.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse exits
            code = e.code if isinstance(e.code, int) else 1
    return int(code or 0), out.getvalue(), err.getvalue()


class RolloutConformanceError(AssertionError):
    """A rollout backend does not behave as the trainer needs (the message names the check)."""


def check_rollout_backend(make_backend: Callable[[Any], Any], model: Any, *, vocab_size: Optional[int] = None,
                          max_new_tokens: int = 6, atol: float = 2e-3) -> list[str]:
    """Check a rollout backend against what the trainer relies on; return the names of the checks passed.

    ``make_backend(model)`` builds the backend for ``model`` (a Hugging Face causal LM, e.g.
    :func:`rlcore.rollout.tiny.tiny_causal_lm`), as ``rlcore_rollout_backend`` would. The checks:

    * ``protocol`` — the backend has ``generate`` and ``sync_weights`` (:class:`~rlcore.protocols.RolloutBackend`);
    * ``shapes`` — prompts of different lengths give ``[B, P]`` left-padded prompts and ``[B, R]``
      responses (``R <= max_new_tokens``) with matching masks, one row per prompt, in order;
    * ``masks`` — masked response positions hold the pad id and log-prob 0; a response mask is ones then zeros;
    * ``eos`` — with an EOS id that greedy decoding produces, each row stops right after its first EOS
      (the EOS itself is kept) and the tokens before it are unchanged;
    * ``seeds`` — the same seed gives the same sample, twice;
    * ``logprobs`` — the sampled tokens' log-probs equal teacher-forced ``log_softmax(logits / T)`` of
      the model (within ``atol``), greedy and sampled;
    * ``sync_weights`` — after the model's weights change in place, ``sync_weights()`` makes the
      backend's log-probs follow the new weights. This check modifies ``model``;
    * ``episodes`` — only for a backend that declares ``supports_episodes = True``: prompts carrying a
      two-turn episode are played (each turn reaches the episode, the observation is appended to the
      response with ``response_mask`` 0 and ``response_attention`` 1).

    Every batch returned is also held to every rule the trainer checks at the plugin boundary
    (:func:`rlcore.contract.rollout_problems`: one row per prompt, widths, 0/1 masks, the prompts in
    order, ``logprobs`` present, finite and at most 0, token ids inside the vocabulary); a batch that
    breaks one fails the check that asked for it.

    :raises RolloutConformanceError: naming the first check that fails and what differed.
    """
    from rlcore.protocols import RolloutBackend
    from rlcore.rollout.base import SamplingParams

    backend = make_backend(model)
    kit = _BackendChecks(backend, model, int(vocab_size or model.config.vocab_size), atol)
    if not isinstance(backend, RolloutBackend):
        kit.fail("protocol", "it lacks generate() or sync_weights()")
    passed = ["protocol"]
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, pad_token_id=kit.pad)
    batch = kit.shapes(greedy)
    passed.append("shapes")
    kit.masks(batch, "masks")
    passed.append("masks")
    kit.eos(batch, greedy)
    passed.append("eos")
    sampled = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=1234, pad_token_id=kit.pad)
    first = kit.seeds(sampled)
    passed.append("seeds")
    for name, got in (("greedy", batch), ("sampled", first)):
        kit.logprobs(name, got)
    passed.append("logprobs")
    kit.sync_weights(batch, greedy)
    passed.append("sync_weights")
    if getattr(backend, "supports_episodes", False):
        _check_episodes(kit.generated, kit.fail, kit.prompts, greedy, kit.vocab)
        passed.append("episodes")
    return passed


class _BackendChecks:
    """The checks of :func:`check_rollout_backend` on one backend, each a method that raises
    :class:`RolloutConformanceError` naming itself."""

    pad = 0

    def __init__(self, backend: Any, model: Any, vocab: int, atol: float):
        self.backend, self.model, self.vocab, self.atol = backend, model, vocab, atol
        prompts = [[5, 9, 14, 3], [7], [11, 12, 13], [4, 4, 8, 21, 6, 2]]
        self.prompts = [[t % vocab or 1 for t in p] for p in prompts]

    def fail(self, check: str, why: str) -> None:
        raise RolloutConformanceError(f"rollout backend {type(self.backend).__name__}: check '{check}' failed: {why}")

    def generated(self, check: str, prompts: Sequence[Sequence[int]], params: Any) -> Any:
        """``backend.generate``, its batch held to the plugin boundary's rules."""
        from rlcore.contract import rollout_problems

        batch = self.backend.generate(prompts, params)
        problems = rollout_problems(batch, prompts, params.max_new_tokens, self.vocab)
        if problems:
            self.fail(check, "the batch breaks the contract: " + "; ".join(problems))
        return batch

    def teacher_forced(self, batch: Any, temperature: float) -> Any:
        import torch

        from rlcore.trainer.models import response_logprobs

        ids, mask = batch.sequences()
        device = next(self.model.parameters()).device
        with torch.no_grad():
            out = response_logprobs(self.model, ids.to(device), mask.to(device), batch.response_ids.shape[1],
                                    temperature)[0].float().cpu()
        return out * batch.response_mask.cpu()

    def shapes(self, greedy: Any) -> Any:
        prompts = self.prompts
        batch = self.generated("shapes", prompts, greedy)
        b, r = batch.response_ids.shape
        if b != len(prompts) or batch.prompt_ids.shape[0] != b or not 0 < r <= greedy.max_new_tokens:
            self.fail("shapes", f"{len(prompts)} prompts gave prompts {tuple(batch.prompt_ids.shape)}, "
                                f"responses {(b, r)}")
        for i, p in enumerate(prompts):
            row = batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()
            if row != p or batch.prompt_mask[i, -len(p):].sum() != len(p):
                self.fail("shapes", f"prompt row {i} is {row}, expected {p} left padded")
        if batch.logprobs.shape != (b, r) or batch.response_mask.shape != (b, r):
            self.fail("shapes", f"logprobs {tuple(batch.logprobs.shape)} / response_mask "
                                f"{tuple(batch.response_mask.shape)}")
        return batch

    def masks(self, batch: Any, check: str) -> None:
        mask = batch.response_mask.cpu().long()
        if (mask[:, 1:] > mask[:, :-1]).any():
            self.fail(check, "a response mask has a one after a zero")
        off = mask == 0
        if (batch.response_ids.cpu()[off] != self.pad).any() or (batch.logprobs.cpu()[off] != 0).any():
            self.fail(check, "masked response positions must hold the pad id and log-prob 0")

    def eos(self, batch: Any, greedy: Any) -> None:
        full = batch.response_ids.cpu()
        b, r = full.shape
        eos = int(full[0, min(2, r - 1)])
        stopped = self.generated("eos", self.prompts, dataclasses.replace(greedy, eos_token_ids=(eos,)))
        self.masks(stopped, "eos")
        for i in range(b):
            ids, keep = stopped.response_ids[i].cpu(), stopped.response_mask[i].cpu().bool()
            row = ids[keep].tolist()
            hits = (full[i] == eos).nonzero()
            expected = full[i, :int(hits[0]) + 1].tolist() if len(hits) else full[i].tolist()
            if row != expected:
                self.fail("eos", f"row {i} with EOS id {eos}: kept {row}, expected {expected}")

    def seeds(self, sampled: Any) -> Any:
        import torch

        first, second = self.generated("seeds", self.prompts, sampled), self.generated("seeds", self.prompts, sampled)
        if not torch.equal(first.response_ids.cpu(), second.response_ids.cpu()):
            self.fail("seeds", "the same seed gave different samples")
        return first

    def logprobs(self, name: str, batch: Any) -> None:
        diff = float((batch.logprobs.float().cpu() - self.teacher_forced(batch, 1.0)).abs().max())
        if diff > self.atol:
            self.fail("logprobs", f"{name} log-probs differ from teacher forcing by {diff:.2e} (> {self.atol})")

    def sync_weights(self, before: Any, greedy: Any) -> None:
        import torch

        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(1.5)
        self.backend.sync_weights()
        after = self.generated("sync_weights", self.prompts, greedy)
        diff = float((after.logprobs.float().cpu() - self.teacher_forced(after, 1.0)).abs().max())
        if diff > self.atol or torch.allclose(after.logprobs.float().cpu(), before.logprobs.float().cpu()):
            self.fail("sync_weights", f"after the weights changed, log-probs differ from teacher forcing by {diff:.2e}")


class _KitEpisodes:
    """A stand-in for the trainer's episode runner: each episode takes two turns, the first answered
    with the observation ``OBSERVATION`` (token ids), the second ending it."""

    OBSERVATION = (3, 4)

    def stops(self) -> tuple[set[int], list[str]]:
        return set(), []

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))

    def submit(self, episode: Any, token_ids: list[int], used: int, budget: int, truncated: bool) -> Any:
        import concurrent.futures

        episode.turns += 1
        episode.model_tokens += len(token_ids)
        room = used + len(self.OBSERVATION) + 1 <= episode.token_limit(budget)
        observation = list(self.OBSERVATION) if episode.turns == 1 and room else None
        episode.done = observation is None
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(observation)
        return future


def _check_episodes(generated: Callable, fail: Callable, prompts: Sequence[Sequence[int]], params: Any,
                    vocab: int) -> None:
    """Prompts carrying a two-turn episode (:class:`_KitEpisodes`) are played: each episode gets its
    turns, and its observation sits in the response with ``response_mask`` 0 and attention 1."""
    import dataclasses as dc

    from rlcore.envs.runner import Episode, EpisodeLimits, EpisodePrompt

    runner = _KitEpisodes()
    observation = [t % vocab for t in runner.OBSERVATION]
    runner.OBSERVATION = tuple(observation)
    episodes = [Episode("conformance", None, {}, EpisodeLimits(max_turns=2), runner) for _ in prompts]
    carried = [EpisodePrompt(p, e) for p, e in zip(prompts, episodes)]
    # a turn ends at its first token here, so every episode has room for the observation and a second turn
    params = dc.replace(params, max_new_tokens=max(params.max_new_tokens, 2 * len(observation) + 4))
    first = generated("episodes", [list(p) for p in prompts], dc.replace(params, max_new_tokens=1))
    stop = tuple(int(t) for t in first.response_ids[:, 0].tolist())
    batch = generated("episodes", carried, dc.replace(params, eos_token_ids=tuple(sorted(set(stop)))))
    unplayed = [i for i, e in enumerate(episodes) if not e.turns]
    if unplayed:
        fail("episodes", f"prompt {unplayed[0]} carried an episode no turn of which reached it (supports_episodes "
                         "is True: play such prompts with rlcore.rollout.turns.play_episodes)")
    attention = batch.attention.cpu()
    for i, episode in enumerate(episodes):
        if episode.turns < 2:
            continue
        ids, model = batch.response_ids[i].cpu(), batch.response_mask[i].cpu()
        observed = ids[(model == 0) & (attention[i] == 1)].tolist()
        if observed[:len(observation)] != observation:
            fail("episodes", f"row {i}: the observation {observation} is not in the response as attended, "
                             f"untrained tokens (found {observed})")


@pytest.fixture
def rlcore_pm():
    from rlcore.plugin_manager import build_plugin_manager

    return build_plugin_manager([])


@pytest.fixture
def rlcore_register(rlcore_pm) -> Iterator[Callable[..., Any]]:
    registered: list[str] = []

    def register(plugin: Any, name: str | None = None) -> Any:
        name = name or getattr(plugin, "__name__", None) or f"test-plugin-{len(registered)}"
        if isinstance(plugin, type):  # a plugin class, as an entry point names it: one instance
            plugin = plugin()
        rlcore_pm.register_plugin(plugin, name)
        registered.append(name)
        return plugin

    yield register
    for name in registered:
        rlcore_pm.unregister_plugin(name)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("rlcore-tiny") / "model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from rlcore.trainer.models import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def teacher_forced_logprobs(model, batch, temperature: float):
    """``[B, R]`` log-probabilities of a :class:`~rlcore.rollout.base.RolloutBatch`'s response tokens
    under ``model`` run once over prompt + response (teacher forcing), at ``temperature`` (``<= 0``: 1);
    what a backend's ``logprobs`` must equal on the response mask."""
    import torch

    ids, mask = batch.sequences()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    width = batch.prompt_ids.shape[1]
    scaled = logits[:, width - 1:-1] / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(scaled, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
