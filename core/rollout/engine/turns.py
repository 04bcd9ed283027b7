"""Multi-turn generation in the engine: a turn ends, the environment answers, the sequence goes on
in the same slot.

:class:`TurnScheduler` extends the continuous-batching :class:`~rlcore.rollout.engine.scheduler.Scheduler`:

* a turn ends at EOS or a stop string (one-token stop strings are flagged on the device with
  EOS; longer ones are found in the turn's text on the steps that read the flags);
* the slot then *pauses*: its turn goes to the episode's environment through the
  :class:`~rlcore.envs.runner.EpisodeRunner` (a future, answered on the runner's thread) and the
  other slots keep decoding; a paused slot is pinned to its turn's last cache column, so the
  steps it rides along in write nowhere that matters;
* when the observation arrives, its tokens (rendered with the chat template) are written after
  the turn's last token with :meth:`RolloutEngine._extend` (a prefill of the new tokens only, the
  slot's KV cache kept), the next token is sampled from its logits, and the slot decodes again;
* an episode ends when the environment says so, at its turn limit, or when the response (model
  and observation tokens) would pass its token budget (``Episode.token_limit``: the episode's
  ``max_tokens``, at most ``max_new_tokens``); a slot whose turn used up the budget
  finishes at once, while its environment still sees that last turn (awaited before the result).
  A prompt without an episode ends at its first turn end.

The result marks model tokens in ``response_mask`` and every token of the sequence (observations
too) in ``response_attention``.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from rlcore.rollout.base import RolloutBatch, SamplingParams, left_pad
from rlcore.rollout.engine.scheduler import Scheduler
from rlcore.rollout.turns import find_turn_end

if TYPE_CHECKING:
    from rlcore.envs.runner import Episode
    from rlcore.rollout.engine import RolloutEngine


class TurnScheduler(Scheduler):
    """One multi-turn ``generate`` call (see the module docstring).

    Args:
        episodes: per prompt, its :class:`~rlcore.envs.runner.Episode` or ``None`` (single turn).
        stop_ids, stop_texts: see :func:`rlcore.rollout.turns.stop_token_ids`.
        decode: ``token ids -> text`` (the tokenizer's, special tokens dropped).
    """

    def __init__(self, engine: "RolloutEngine", prompts: Sequence[Sequence[int]], params: SamplingParams,
                 episodes: Sequence[Optional["Episode"]], stop_ids: set[int], stop_texts: Sequence[str], decode):
        # each request's response budget: its episode's token limit (env.max_tokens), at most max_new_tokens
        self.limit = [int(params.max_new_tokens) if ep is None else ep.token_limit(params.max_new_tokens)
                      for ep in episodes]
        super().__init__(engine, prompts, params)
        self.episodes = list(episodes)
        self.end_ids = set(params.eos_token_ids) | set(stop_ids)
        self.eos = torch.tensor(sorted(self.end_ids), dtype=torch.long, device=engine.device)
        self.stop_texts = list(stop_texts)
        self.decode_text = decode
        cap = engine.max_batch_size
        self.turn_start = [0] * cap  # response column where the slot's current turn starts
        self.base_col = [0] * cap  # cache column of response token 0
        self.base_pos = [0] * cap  # RoPE position of response token 0
        self.paused: dict[int, tuple[concurrent.futures.Future, int]] = {}  # slot -> (answer, turn's last column)
        self.length = [0] * len(prompts)  # response tokens of each finished request
        self.spans: list[list[tuple[int, int]]] = [[] for _ in prompts]  # observation columns [start, end)
        self.env_waits = 0
        self.closing: list[concurrent.futures.Future] = []  # last turns of finished episodes, still with their environment

    # -- admission and compaction keep the per-slot lists
    def _admit(self) -> None:
        before = set(s for s, r in enumerate(self.slot_req) if r is not None)
        super()._admit()
        for s, r in enumerate(self.slot_req):
            if r is not None and s not in before:
                self.turn_start[s] = 0
                self.base_col[s] = self.col0[s] + self.born[s]  # the padded prompt width
                self.base_pos[s] = len(self.prompts[r])

    def _maybe_compact(self) -> None:
        old = list(self.live)
        super()._maybe_compact()
        if self.live == old or len(self.live) != len(old):
            return
        cap = len(self.slot_req)
        for name in ("turn_start", "base_col", "base_pos"):
            values = getattr(self, name)
            setattr(self, name, [values[s] for s in old] + [0] * (cap - len(old)))
        where = {s: i for i, s in enumerate(old)}
        self.paused = {where[s]: v for s, v in self.paused.items()}

    def _relive(self) -> None:
        super()._relive()
        if hasattr(self, "limit"):  # the first step at which a live slot reaches its own budget
            self.due = min((self.born[s] + self.limit[self.slot_req[s]] - 1 for s in self.live), default=0)
        self._pin()

    def _pin(self) -> None:
        """Keep paused slots at their turn's last column (their decode-step writes land there and
        are replaced when the observation comes), and the attended length covering them."""
        decoding = [s for s in self.live if s not in self.paused]
        self.max_col0 = max([self.col0[s] for s in decoding]
                            + [self.base_col[s] + e - self.steps for s, (_, e) in self.paused.items()], default=0)
        if self.paused:
            slots = sorted(self.paused)
            rows = torch.tensor(slots, dtype=torch.long, device=self.eng.device)
            cols = torch.tensor([self.base_col[s] + self.paused[s][1] for s in slots], dtype=torch.long,
                                device=self.eng.device)
            positions = torch.tensor([self.base_pos[s] + self.paused[s][1] for s in slots], dtype=torch.long,
                                     device=self.eng.device)
            self.eng.state.cache_index[rows] = cols
            self.eng.state.positions[rows] = positions

    # -- turn ends
    def _finished(self, n: int) -> list[int]:
        finished = super()._finished(n)
        if self.steps >= self.due:
            finished += [s for s in self.live if s not in self.paused
                         and self._count(s) >= self.limit[self.slot_req[s]]]
        if self.stop_texts and self.steps % self.eng.eos_check_interval == 0:
            candidates = [s for s in self.live if s not in self.paused and s not in finished]
            if candidates:
                rows = self.out_tokens[candidates].tolist()
                for s, row in zip(candidates, rows):
                    count = min(self._count(s), len(row))
                    if find_turn_end(row, self.turn_start[s], count, set(), self.stop_texts,
                                     self.decode_text) is not None:
                        finished.append(s)
        return sorted(set(finished) - set(self.paused))

    def _finish(self, slots: list[int]) -> None:
        slots = [s for s in slots if s not in self.paused]
        if not slots:
            return
        rows = self.out_tokens[slots].tolist()
        over = []
        for s, row in zip(slots, rows):
            limit = self.limit[self.slot_req[s]]
            count = min(self._count(s), limit)
            end = find_turn_end(row, self.turn_start[s], count, self.end_ids, self.stop_texts, self.decode_text)
            truncated = end is None
            if truncated:
                if count < limit:
                    continue  # a stale flag: the turn goes on
                end = limit - 1
            req = self.slot_req[s]
            episode = self.episodes[req]
            if episode is None or end + 1 >= limit:
                if episode is not None:
                    # the budget is spent: the environment sees the last turn (for its reward) while
                    # the slot finishes now. Paused, it would ride along in decode steps whose
                    # sampled tokens land in the last response column, over the turn's last token.
                    self.closing.append(episode.turn_ended(row[self.turn_start[s]:end + 1], end + 1, limit,
                                                           truncated=True))
                self.length[req] = end + 1
                over.append(s)
                continue
            self.paused[s] = (episode.turn_ended(row[self.turn_start[s]:end + 1], end + 1, limit, truncated), end)
        if over:
            super()._finish(over)
        self._pin()

    def _between_steps(self) -> None:
        """Continue (or end) the paused slots whose environment answered; wait for one when no slot
        could decode or be admitted meanwhile."""
        while self.paused:
            ready = [s for s, (future, _) in self.paused.items() if future.done()]
            if ready:
                self._resume(sorted(ready))
                continue_waiting = False
            else:
                decoding = any(s not in self.paused for s in self.live)
                continue_waiting = not decoding and not self._should_admit()
            if not continue_waiting:
                break
            self.env_waits += 1
            concurrent.futures.wait([f for f, _ in self.paused.values()],
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        if self.paused:
            self._pin()

    def _resume(self, slots: list[int]) -> None:
        eng, st = self.eng, self.eng.state
        over = []
        for s in slots:
            future, end = self.paused.pop(s)
            obs = future.result()  # an environment error propagates here
            req = self.slot_req[s]
            limit = self.limit[req]
            if obs is None or end + 1 + len(obs) + 1 > limit:
                self.length[req] = end + 1
                over.append(s)
                continue
            last = int(self.out_tokens[s, end])
            start = end + 1
            logits = eng._extend(s, [last] + list(obs), self.base_col[s] + end, self.base_pos[s] + end)
            token, logprob = self.sample(logits[None])
            k = len(obs)
            if k:
                self.out_tokens[s, start:start + k] = torch.tensor(obs, dtype=torch.long, device=eng.device)
                self.out_logprobs[s, start:start + k] = 0.0
                self.spans[req].append((start, start + k))
            self.out_tokens[s, start + k] = token[0]
            self.out_logprobs[s, start + k] = logprob[0]
            self.out_col[s] = start + k + 1
            st.tokens[s] = token[0]
            self.done[s] = bool(int(token[0]) in self.end_ids)
            self.turn_start[s] = start + k
            # the slot now holds start + k + 1 response tokens; its next cache column follows them
            self.born[s] = self.steps - (start + k)
            self.col0[s] = self.base_col[s] + start + k - self.steps
        if over:
            super()._finish(over)
        self._relive()

    def result(self) -> RolloutBatch:
        for future in self.closing:  # every episode's last step is done (an environment error propagates)
            future.result()
        eng = self.eng
        prompt_ids, prompt_mask = left_pad(self.prompts, self.params.pad_token_id, eng.device)
        width = max(max(self.length, default=1), 1)
        lengths = torch.tensor(self.length, dtype=torch.long, device=eng.device)
        attention = (torch.arange(width, device=eng.device)[None] < lengths[:, None]).long()
        model = attention.clone()
        for req, spans in enumerate(self.spans):
            for a, b in spans:
                model[req, a:b] = 0
        tokens = self.res_tokens[:, :width].masked_fill(attention == 0, self.params.pad_token_id)
        logprobs = self.res_logprobs[:, :width] * model
        stats = {"rollout/decode_steps": float(self.steps), "rollout/prefill_calls": float(self.prefills),
                 "rollout/new_tokens": float(model.sum().item()),
                 "rollout/observation_tokens": float((attention - model).sum().item()),
                 "rollout/env_waits": float(self.env_waits)}
        return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=tokens,
                            response_mask=model, logprobs=logprobs, stats=stats, response_attention=attention)
