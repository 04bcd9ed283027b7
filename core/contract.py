"""What rlcore checks of a plugin's answers where they cross the plugin boundary.

A factory's answer is checked against its protocol when it is built
(:func:`rlcore.plugin_manager.check_answer`); what the built objects return is checked here, each
time, before the trainer uses it: a wrong answer stops the run with a short
:class:`~rlcore.errors.PluginError` that names the plugin and what was wrong, never a traceback
from deep inside the trainer and never a run that goes on with it.

* every :class:`~rlcore.rollout.base.RolloutBatch` a rollout backend returns
  (:func:`rollout_problems`: rows, widths, masks, log-probs, token ids, the prompts it was given);
* a backend asked to play multi-turn episodes that does not declare ``supports_episodes``, or that
  returns without playing them (:meth:`RolloutContract.admit`, :func:`unplayed_episodes`);
* a reshard policy's :class:`~rlcore.protocols.GenerationShare` and the rows it keeps (:func:`check_share`);
* a reward backend's :class:`~rlcore.protocols.RewardOutput` (:func:`check_reward_output`: one score per
  sample, a 1-D tensor, numeric metrics; finiteness is checked per sample by the scorer);
* a checkpoint policy's ``resume`` step (:func:`check_resume_step`) and a placement policy's
  devices and ranks (:func:`check_placement`).

docs/plugins.md ("What rlcore checks of a plugin's answers") lists the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from rlcore.errors import PluginError

#: problems listed in one error at most (the message stays one screen)
MAX_LISTED = 8
#: a log-probability above this is not one (a probability, a logit)
LOGPROB_SLACK = 1e-4

_BATCH_TENSORS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "logprobs")


def _error(plugin: str, what: str, problems: Sequence[str]) -> PluginError:
    listed = [f"  - {p}" for p in problems[:MAX_LISTED]]
    if len(problems) > MAX_LISTED:
        listed.append(f"  … and {len(problems) - MAX_LISTED} more")
    return PluginError(f"plugin '{plugin}': {what}:\n" + "\n".join(listed))


def _shape_problems(batch: Any, rows: int) -> list[str]:
    """Missing tensors, rows other than ``rows`` and widths that disagree: the problems that make
    every later check meaningless."""
    out = []
    for name in _BATCH_TENSORS:
        value = getattr(batch, name, None)
        if not isinstance(value, torch.Tensor):
            out.append(f"{name} is {'missing' if value is None else type(value).__name__}, not a tensor")
        elif value.dim() != 2:
            out.append(f"{name} has shape {tuple(value.shape)}, not [rows, width]")
    attention = getattr(batch, "response_attention", None)
    if attention is not None and (not isinstance(attention, torch.Tensor) or attention.dim() != 2):
        out.append("response_attention is neither None nor a [rows, width] tensor")
    if out:
        return out
    counts = {name: int(getattr(batch, name).shape[0]) for name in _BATCH_TENSORS}
    wrong = {name: got for name, got in counts.items() if got != rows}
    if wrong and len(set(counts.values())) == 1:
        return [f"the batch has {counts['prompt_ids']} rows for {rows} prompts (one row per prompt, in order)"]
    if wrong:
        return [f"{name} has {got} rows for {rows} prompts (one row per prompt, in order)" for name, got in wrong.items()]
    if batch.prompt_mask.shape != batch.prompt_ids.shape:
        out.append(f"prompt_mask {tuple(batch.prompt_mask.shape)} differs from prompt_ids {tuple(batch.prompt_ids.shape)}")
    width = tuple(batch.response_ids.shape)
    for name in ("response_mask", "logprobs") + (("response_attention",) if attention is not None else ()):
        if tuple(getattr(batch, name).shape) != width:
            out.append(f"{name} {tuple(getattr(batch, name).shape)} differs from response_ids {width}")
    return out


def rollout_problems(batch: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     vocab_size: Optional[int] = None) -> list[str]:
    """Every way ``batch`` breaks the :class:`~rlcore.rollout.base.RolloutBatch` contract as the answer
    to ``prompts`` sampled with at most ``max_new_tokens`` new tokens (empty: none). The rules:

    * the five tensors are there (``logprobs`` too), 2-D, one row per prompt;
    * ``prompt_mask`` has the width of ``prompt_ids``; ``response_mask``, ``logprobs`` (and
      ``response_attention`` when set) the width of ``response_ids``;
    * token ids are integers, log-probs floating point; masks hold only 0 and 1;
    * row ``i``'s unmasked prompt tokens are prompt ``i`` (left padded), in order;
    * a response holds at most ``max_new_tokens`` tokens; the model's tokens (``response_mask``) are
      among the attended ones (``response_attention``);
    * log-probs are finite everywhere and at most 0 on the response mask;
    * every unmasked token id is inside the vocabulary ``[0, vocab_size)`` (when known);
    * ``cut``, when set, is a boolean tensor with one value per row.
    """
    problems = _shape_problems(batch, len(prompts))
    if problems:
        return problems
    for name in ("prompt_ids", "response_ids", "prompt_mask", "response_mask"):
        if getattr(batch, name).is_floating_point():
            problems.append(f"{name} is {getattr(batch, name).dtype}, not an integer tensor")
    if not batch.logprobs.is_floating_point():
        problems.append(f"logprobs is {batch.logprobs.dtype}, not floating point")
    if problems:
        return problems
    attention = batch.response_mask if batch.response_attention is None else batch.response_attention
    pmask, rmask, amask = batch.prompt_mask.cpu(), batch.response_mask.cpu(), attention.cpu()
    for name, mask in (("prompt_mask", pmask), ("response_mask", rmask), ("response_attention", amask)):
        if ((mask != 0) & (mask != 1)).any():
            problems.append(f"{name} holds values other than 0 and 1")
    if problems:
        return problems
    pids = batch.prompt_ids.cpu()
    for i, prompt in enumerate(prompts):
        got = pids[i][pmask[i].bool()].tolist()
        if got != [int(t) for t in prompt]:
            problems.append(f"row {i}: its prompt tokens {_short(got)} are not prompt {i} {_short(list(prompt))}")
            break
    lengths = amask.sum(-1)
    if len(lengths) and int(lengths.max()) > max_new_tokens:
        problems.append(f"row {int(lengths.argmax())} has {int(lengths.max())} response tokens, more than "
                        f"max_new_tokens={max_new_tokens}")
    if ((rmask == 1) & (amask == 0)).any():
        problems.append("response_mask marks tokens that response_attention leaves out")
    logprobs = batch.logprobs.detach().float().cpu()
    if not torch.isfinite(logprobs).all():
        bad = (~torch.isfinite(logprobs)).nonzero()[0].tolist()
        problems.append(f"logprobs are not finite (row {bad[0]}, column {bad[1]}: {float(logprobs[bad[0], bad[1]])})")
    elif (logprobs[rmask.bool()] > LOGPROB_SLACK).any():
        problems.append(f"logprobs above 0 on the response mask (max {float(logprobs[rmask.bool()].max()):.3g}): "
                        "log-probabilities of the sampled tokens are at most 0")
    if vocab_size:
        for name, ids, mask in (("prompt_ids", pids, pmask), ("response_ids", batch.response_ids.cpu(), amask)):
            used = ids[mask.bool()]
            if len(used) and (int(used.min()) < 0 or int(used.max()) >= vocab_size):
                problems.append(f"{name} holds token id {int(used.max()) if int(used.max()) >= vocab_size else int(used.min())}"
                                f", outside the vocabulary [0, {vocab_size})")
    cut = getattr(batch, "cut", None)
    if cut is not None and (not isinstance(cut, torch.Tensor) or cut.dtype != torch.bool
                            or tuple(cut.shape) != (len(prompts),)):
        got = f"{cut.dtype} of shape {tuple(cut.shape)}" if isinstance(cut, torch.Tensor) else type(cut).__name__
        problems.append(f"cut is {got}, not a bool tensor of one value per row ({len(prompts)})")
    return problems


def _short(ids: Sequence[int], keep: int = 8) -> str:
    ids = list(ids)
    return str(ids) if len(ids) <= keep else f"[{', '.join(map(str, ids[:keep]))}, … ({len(ids)} tokens)]"


def unplayed_episodes(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Indices of the prompts that carry an episode (:class:`~rlcore.envs.runner.EpisodePrompt`) no turn
    of which reached its environment: a backend that returned them played them as plain prompts."""
    return [i for i, p in enumerate(prompts)
            if getattr(p, "episode", None) is not None and not getattr(p.episode, "turns", 0)]


def carries_episodes(prompts: Sequence[Sequence[int]]) -> bool:
    return any(getattr(p, "episode", None) is not None for p in prompts)


def refuse_episodes(plugin: str, backend: Any) -> PluginError:
    """The error for a backend asked to play episodes that does not declare ``supports_episodes``."""
    return PluginError(
        f"plugin '{plugin}': its rollout backend {type(backend).__name__} does not play multi-turn episodes "
        "(no supports_episodes = True), and data.env_key is set: its episodes would be sampled as plain prompts "
        "and never reach their environments. Use actor.rollout_backend=auto, engine or hf, unset data.env_key, or "
        "give the backend supports_episodes = True and play the episodes with rlcore.rollout.turns.play_episodes "
        "(docs/plugins.md, 'A rollout backend plugin')")


@dataclass
class RolloutContract:
    """The checks :class:`~rlcore.trainer.generation.ActorGeneration` runs on each rollout backend call.

    :param vocab_size: the actor's vocabulary (token ids must be below it); None: not checked.
    :param names: the plugin that built each backend, by ``id`` of the backend.
    """

    vocab_size: Optional[int] = None
    names: dict[int, str] = field(default_factory=dict)

    def plugin(self, backend: Any) -> str:
        return self.names.get(id(backend), type(backend).__name__)

    def admit(self, backend: Any, prompts: Sequence[Sequence[int]]) -> None:
        """Before ``backend.generate(prompts)``: prompts carrying episodes need a backend that plays them."""
        if carries_episodes(prompts) and not getattr(backend, "supports_episodes", False):
            raise refuse_episodes(self.plugin(backend), backend)

    def check(self, backend: Any, batch: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        """After ``backend.generate(prompts)``: the batch keeps the contract and every episode was played.

        :raises PluginError: naming the plugin and each problem (at most :data:`MAX_LISTED`)."""
        problems = rollout_problems(batch, prompts, max_new_tokens, self.vocab_size)
        unplayed = unplayed_episodes(prompts)
        if unplayed:
            problems.append(f"{len(unplayed)} of the prompts carried an episode that was never played (prompt "
                            f"{unplayed[0]} first): its turns must reach the environment "
                            "(rlcore.rollout.turns.play_episodes)")
        if problems:
            raise _error(self.plugin(backend), f"its rollout backend {type(backend).__name__}.generate returned a "
                         f"RolloutBatch that breaks the contract for {len(prompts)} prompts", problems)


def check_share(share: Any, prompts: Sequence[Sequence[int]], plugin: str = "reshard policy") -> None:
    """A reshard policy's :class:`~rlcore.protocols.GenerationShare`: prompts, params and ``own()``."""
    missing = [a for a in ("prompts", "params", "own") if not hasattr(share, a)]
    if missing:
        raise PluginError(f"plugin '{plugin}': generation_share() returned a {type(share).__name__}, which lacks "
                          f"{', '.join(missing)}: return rlcore.protocols.GenerationShare(prompts, params)")
    if len(share.prompts) == 0 and len(prompts):
        raise PluginError(f"plugin '{plugin}': generation_share() gave this rank no prompts to generate for its "
                          f"{len(prompts)}")


def check_own_rows(batch: Any, prompts: Sequence[Sequence[int]], plugin: str = "reshard policy") -> None:
    """The rows a :class:`~rlcore.protocols.GenerationShare` keeps as this rank's: one per prompt of the rank."""
    rows = getattr(getattr(batch, "prompt_ids", None), "shape", (None,))[0]
    if rows != len(prompts):
        raise PluginError(f"plugin '{plugin}': the rows its GenerationShare keeps for this rank are {rows}, for "
                          f"{len(prompts)} prompts (GenerationShare.rows must name this rank's rows of the pool)")


def check_reward_output(output: Any, count: int, plugin: str = "reward backend") -> torch.Tensor:
    """A reward backend's answer for ``count`` samples: its ``scores`` as a float32 CPU tensor ``[count]``.

    :raises PluginError: not a :class:`~rlcore.protocols.RewardOutput` (no ``scores``), scores that are not
        a 1-D tensor of ``count`` numbers, or metrics that are not numbers by name."""
    scores = getattr(output, "scores", None)
    what = f"its reward backend's score() answered {count} samples with"
    if scores is None:
        raise PluginError(f"plugin '{plugin}': {what} a {type(output).__name__} without scores: return "
                          "rlcore.protocols.RewardOutput(scores=torch.tensor([...]))")
    if not isinstance(scores, torch.Tensor):
        raise PluginError(f"plugin '{plugin}': {what} scores of type {type(scores).__name__}, not a tensor")
    if scores.dim() != 1 or scores.shape[0] != count:
        raise PluginError(f"plugin '{plugin}': {what} scores of shape {tuple(scores.shape)}, not [{count}] "
                          "(one score per sample, in order)")
    if scores.is_complex() or scores.dtype == torch.bool:
        raise PluginError(f"plugin '{plugin}': {what} {scores.dtype} scores, not real numbers")
    metrics = getattr(output, "metrics", {}) or {}
    bad = [k for k, v in dict(metrics).items() if not isinstance(v, (int, float)) and
           not (isinstance(v, torch.Tensor) and v.numel() == 1)]
    if bad:
        raise PluginError(f"plugin '{plugin}': its reward backend's metrics must be numbers by name; "
                          f"'{bad[0]}' is {type(metrics[bad[0]]).__name__}")
    return scores.detach().float().cpu()


def check_resume_step(step: Any, plugin: str = "checkpoint policy") -> int:
    """A checkpoint policy's ``resume()`` answer: a whole number of steps, 0 or more."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point() and int(step) >= 0:
            return int(step)
        raise PluginError(f"plugin '{plugin}': its checkpoint policy's resume() returned {step!r}; it returns the "
                          "step to continue from, a whole number >= 0 (0: a fresh run)")
    return int(step)


def check_placement(placement: Any, roles: Sequence[str], dist: Any, plugin: str = "placement policy") -> None:
    """A placement policy's answers for ``roles``: ranks inside the world (at least one), and a device
    for each role this rank (``dist``, a :class:`~rlcore.protocols.DistInfo`) holds."""
    for role in roles:
        ranks = list(placement.ranks_for(role))
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < dist.world_size]
        if bad or not ranks:
            raise PluginError(f"plugin '{plugin}': its placement policy's ranks_for({role!r}) returned {ranks!r}; "
                              f"ranks are whole numbers in [0, {dist.world_size}), at least one")
        if dist.rank not in ranks:
            continue
        device = placement.device_for(role)
        try:
            torch.device(device)
        except (TypeError, RuntimeError) as error:
            raise PluginError(f"plugin '{plugin}': its placement policy's device_for({role!r}) returned {device!r}, "
                              f"not a device ({error})") from error
