"""Multi-turn episodes through a backend that generates one turn at a time (Hugging Face
``generate``): any causal LM works, but each turn runs the whole sequence again (no KV cache is
kept between turns), so it is slower than the engine's :mod:`rlcore.rollout.engine.turns`.

Every round generates the next turn of all unfinished episodes as one batch, cuts each at its
turn end (EOS or a stop string), sends the turns to their environments together (they answer
concurrently on the :class:`~rlcore.envs.runner.EpisodeRunner`'s loop) and appends the
observations.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from rlcore.rollout.base import RolloutBatch, SamplingParams, left_pad

if TYPE_CHECKING:  # pragma: no cover
    from rlcore.envs.runner import Episode, EpisodeRunner


def find_turn_end(tokens: Sequence[int], start: int, count: int, end_ids: set[int], stop_texts: Sequence[str],
                  decode: Callable[[Sequence[int]], str]) -> Optional[int]:
    """The index of the token that ends the turn beginning at ``start`` among the first ``count``
    of ``tokens``: the first end token (EOS or a one-token stop string), or the token that
    completes a longer stop string, whichever comes first; ``None`` if the turn goes on."""
    end = next((i for i in range(start, count) if tokens[i] in end_ids), None)
    if stop_texts:
        limit = count if end is None else end
        if limit > start and any(s in decode(tokens[start:limit]) for s in stop_texts):
            lo, hi = start, limit - 1  # the shortest prefix holding a stop string
            while lo < hi:
                mid = (lo + hi) // 2
                if any(s in decode(tokens[start:mid + 1]) for s in stop_texts):
                    hi = mid
                else:
                    lo = mid + 1
            end = lo
    return end


def stop_token_ids(tokenizer, stop: Sequence[str]) -> tuple[set[int], list[str]]:
    """``(ids, texts)``: stop strings that are one token of ``tokenizer`` (flagged with EOS) and
    the others (found in the decoded text)."""
    ids, texts = set(), []
    unk = getattr(tokenizer, "unk_token_id", None)
    for text in stop:
        enc = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(enc) == 1 and enc[0] != unk:
            ids.add(int(enc[0]))
        else:
            texts.append(text)
    return ids, texts


def episodes_of(prompts: Sequence[Sequence[int]]) -> tuple[list[Optional["Episode"]], Optional["EpisodeRunner"]]:
    """The episode of each prompt (``None`` for plain prompts) and their runner (``None`` when no
    prompt carries an episode)."""
    episodes = [getattr(p, "episode", None) for p in prompts]
    runner = next((e.runner for e in episodes if e is not None), None)
    return episodes, runner


def play_episodes(generate: Callable[[Sequence[Sequence[int]], SamplingParams], RolloutBatch],
                  prompts: Sequence[Sequence[int]], params: SamplingParams,
                  device: torch.device | str = "cpu") -> RolloutBatch:
    """What a rollout backend's ``generate`` does with prompts that may carry multi-turn episodes
    (``data.env_key``): plain prompts are one call of ``generate``; prompts carrying an episode
    (:class:`~rlcore.envs.runner.EpisodePrompt`) are played turn by turn with it
    (:func:`generate_turn_by_turn`), each turn's tokens sent to the episode's environment and its
    observation appended, until the environment ends the episode or a limit does.

    ``generate(prompts, params)`` samples one turn per prompt: a single-turn
    :class:`~rlcore.rollout.base.RolloutBatch` (the backend's own sampling, stopping at any of
    ``params.eos_token_ids``). A backend that plays episodes declares ``supports_episodes = True``
    and calls this from its ``generate``; ``device`` is where the result's tensors go."""
    episodes, runner = episodes_of(prompts)
    if runner is None:
        return generate(prompts, params)
    return generate_turn_by_turn(generate, prompts, params, episodes, runner, device)


def generate_turn_by_turn(generate: Callable[[Sequence[Sequence[int]], SamplingParams], RolloutBatch],
                          prompts: Sequence[Sequence[int]], params: SamplingParams, episodes: Sequence, runner,
                          device: torch.device | str = "cpu") -> RolloutBatch:
    """Play ``prompts`` (an episode each, or ``None`` for a single turn) with ``generate``, one turn
    per round; the result marks model tokens in ``response_mask`` and every token in
    ``response_attention``. An episode's response holds at most its
    :meth:`~rlcore.envs.runner.Episode.token_limit` tokens (``env.max_tokens``), a single turn at
    most ``max_new_tokens``."""
    limits = [params.max_new_tokens if ep is None else ep.token_limit(params.max_new_tokens) for ep in episodes]
    stop_ids, stop_texts = runner.stops()
    end_ids = set(params.eos_token_ids) | stop_ids
    tokens: list[list[int]] = [[] for _ in prompts]
    model: list[list[int]] = [[] for _ in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    rounds, seconds = 0, 0.0
    while active:
        budget = max(1, max(limits[i] - len(tokens[i]) for i in active))
        seed = None if params.seed is None else params.seed + 7919 * rounds
        turn_params = dataclasses.replace(params, max_new_tokens=budget, eos_token_ids=tuple(sorted(end_ids)),
                                          seed=seed)
        batch = generate([list(prompts[i]) + tokens[i] for i in active], turn_params)
        seconds += batch.stats.get("rollout/seconds", 0.0)
        ids, mask, lps = batch.response_ids.tolist(), batch.response_mask.tolist(), batch.logprobs.tolist()
        pending: dict[int, concurrent.futures.Future] = {}
        for row, i in enumerate(active):
            limit = limits[i]
            room = limit - len(tokens[i])
            new = [t for t, m in zip(ids[row], mask[row]) if m][:room]
            end = find_turn_end(new, 0, len(new), end_ids, stop_texts, runner.decode)
            truncated = end is None
            turn = new if end is None else new[:end + 1]
            tokens[i] += turn
            model[i] += [1] * len(turn)
            logprobs[i] += lps[row][:len(turn)]
            if episodes[i] is not None:
                pending[i] = episodes[i].turn_ended(turn, len(tokens[i]), limit,
                                                    truncated or len(tokens[i]) >= limit)
        concurrent.futures.wait(list(pending.values()))
        active = []
        for i, future in pending.items():
            obs = future.result()
            if obs is None or len(tokens[i]) + len(obs) + 1 > limits[i]:
                continue
            tokens[i] += list(obs)
            model[i] += [0] * len(obs)
            logprobs[i] += [0.0] * len(obs)
            active.append(i)
        rounds += 1
    prompt_ids, prompt_mask = left_pad(prompts, params.pad_token_id, device)
    width = max(1, max(len(t) for t in tokens))

    def right(rows, fill, dtype):
        return torch.tensor([r + [fill] * (width - len(r)) for r in rows], dtype=dtype, device=device)

    model_mask = right(model, 0, torch.long)
    attention = right([[1] * len(t) for t in tokens], 0, torch.long)
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                        response_ids=right(tokens, params.pad_token_id, torch.long), response_mask=model_mask,
                        logprobs=right(logprobs, 0.0, torch.float32), response_attention=attention,
                        stats={"rollout/seconds": seconds, "rollout/new_tokens": float(model_mask.sum()),
                               "rollout/observation_tokens": float((attention - model_mask).sum()),
                               "rollout/turn_rounds": float(rounds)})
