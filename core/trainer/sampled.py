"""The scored samples of one step (:class:`Sampled`): what a rollout source hands the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from rlcore.rollout.base import RolloutBatch
from rlcore.trainer.update import Accumulated


@dataclass
class Sampled:
    """Scored samples of one step: ``B`` samples in groups of ``n`` consecutive ones (one prompt each)."""

    rollout: RolloutBatch
    scores: torch.Tensor  # [B] what the advantages see (overlong penalty included)
    raw_scores: torch.Tensor  # [B] the reward backend's scores
    reward_metrics: dict[str, float]
    truncated: torch.Tensor  # [B] bool
    group_ids: torch.Tensor  # [B] long
    baseline: Optional[torch.Tensor] = None  # [B] ReMax greedy baseline
    metrics: dict[str, float] = field(default_factory=dict)
    overlap: Optional[Accumulated] = None  # micro-batches trained during the rollout (ppo.overlap_update)

    def select_groups(self, groups: torch.Tensor, n: int) -> "Sampled":
        """The samples of the given groups (indices into this batch's groups), in that order."""
        idx = (groups.view(-1, 1) * n + torch.arange(n)).flatten()
        r = self.rollout
        rollout = RolloutBatch(prompt_ids=r.prompt_ids[idx.to(r.prompt_ids.device)],
                               prompt_mask=r.prompt_mask[idx.to(r.prompt_ids.device)],
                               response_ids=r.response_ids[idx.to(r.response_ids.device)],
                               response_mask=r.response_mask[idx.to(r.response_ids.device)],
                               logprobs=r.logprobs[idx.to(r.logprobs.device)], stats=dict(r.stats),
                               response_attention=None if r.response_attention is None else
                               r.response_attention[idx.to(r.response_attention.device)])
        return Sampled(rollout=rollout, scores=self.scores[idx], raw_scores=self.raw_scores[idx],
                       reward_metrics=dict(self.reward_metrics), truncated=self.truncated[idx],
                       group_ids=self.group_ids[idx], baseline=None if self.baseline is None else self.baseline[idx],
                       metrics=dict(self.metrics))

    @staticmethod
    def concat(parts: list["Sampled"], n: int, pad_token_id: int, groups: int) -> "Sampled":
        """The first ``groups`` groups of ``parts`` joined, group ids renumbered so no two parts share one."""
        from rlcore.rollout.base import concat_batches

        ids, offset = [], 0
        for p in parts:
            ids.append(p.group_ids + offset)
            offset += int(p.group_ids.max()) + 1 if len(p.group_ids) else 0
        metrics: dict[str, list[float]] = {}
        for p in parts:
            for k, v in p.reward_metrics.items():
                metrics.setdefault(k, []).append(v)
        joined = Sampled(rollout=concat_batches([p.rollout for p in parts], pad_token_id),
                         scores=torch.cat([p.scores for p in parts]), raw_scores=torch.cat([p.raw_scores for p in parts]),
                         reward_metrics={k: sum(v) / len(v) for k, v in metrics.items()},
                         truncated=torch.cat([p.truncated for p in parts]), group_ids=torch.cat(ids),
                         baseline=None if parts[0].baseline is None else torch.cat([p.baseline for p in parts]))
        return joined.select_groups(torch.arange(groups), n)
