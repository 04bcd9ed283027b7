"""The objects factory hooks return, as ``typing.Protocol`` classes, and the small value types they share.

A plugin's object need not inherit from these classes; it only needs the methods. Tests check
built-in plugins with ``isinstance`` (the protocols are ``runtime_checkable``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from rlcore.config.schema import FSDPConfig

ROLES = ("actor", "critic", "ref", "reward")


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class PlacementRequest:
    """What the user asked for: a device string per role (``auto``, ``cpu``, ``cuda``, ``cuda:N``)."""

    actor: str = "auto"
    critic: str = "auto"
    ref: str = "auto"
    reward: str = "auto"
    reward_offload: bool = False
    #: rank groups per role when roles are split over ranks, e.g. {"reward": [3]}; empty = colocated.
    rank_groups: Mapping[str, Sequence[int]] = field(default_factory=dict)


@runtime_checkable
class PlacementPolicy(Protocol):
    """Decides where each role (actor, critic, ref, reward) lives."""

    def device_for(self, role: str) -> torch.device:
        """The device on which ``role`` computes in this process."""
        ...

    def ranks_for(self, role: str) -> Sequence[int]:
        """The global ranks that hold ``role``."""
        ...

    def offload(self, role: str) -> bool:
        """Whether ``role``'s weights rest in CPU memory between uses."""
        ...


@runtime_checkable
class ReshardPolicy(Protocol):
    """Switches the actor between its training layout and its generation layout."""

    def prepare(self, model: torch.nn.Module, role: str, fsdp: Optional[FSDPConfig] = None) -> torch.nn.Module:
        """Wrap ``model`` for training (e.g. ``fully_shard``) and return the module to train.

        ``fsdp`` is the role's own effective sharding settings (``<role>.fsdp`` over the top-level
        ``fsdp``); ``None`` means the settings the policy was built with (the actor's). A policy
        whose ``prepare`` takes no ``fsdp`` keeps its own settings for every role (with a warning
        when the critic's differ)."""
        ...

    def generation(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """Context manager yielding a module that generates; on exit the training layout is restored."""
        ...

    def stats(self) -> dict[str, float]:
        """Timing of the last switch (seconds), e.g. ``{"reshard/to_gen_s": ..., "reshard/to_train_s": ...}``."""
        ...


@dataclass
class RewardInput:
    """One batch to score. Lists have one entry per sample."""

    prompts: list[str]
    responses: list[str]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    #: Extra dataset columns, each a list with one value per sample.
    extras: dict[str, list[Any]] = field(default_factory=dict)


@dataclass
class RewardOutput:
    """Scores ``[N]`` (float32) plus named components and counters for the metrics."""

    scores: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class RewardBackend(Protocol):
    """Scores a batch of prompt/response pairs."""

    def score(self, batch: RewardInput) -> RewardOutput:
        """Return one finite score per sample; raise :class:`rlcore.errors.RewardError` otherwise."""
        ...


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@runtime_checkable
class CheckpointPolicy(Protocol):
    """When to save, what to keep, how to resume."""

    def should_save(self, step: int, *, final: bool = False) -> bool:
        """Whether to save after optimizer step ``step``."""
        ...

    def save(self, step: int, state: Mapping[str, Stateful]) -> Optional[str]:
        """Write a checkpoint of every stateful object; return its path (main rank) or None."""
        ...

    def resume(self, state: Mapping[str, Stateful]) -> int:
        """Load the checkpoint chosen by ``trainer.resume`` into ``state``; return the step to continue from (0 = fresh)."""
        ...

    def export(self, model: torch.nn.Module, tokenizer: Any, name: str = "final") -> Optional[str]:
        """Write ``model`` and ``tokenizer`` as a Hugging Face directory; return its path."""
        ...



@runtime_checkable
class RolloutSource(Protocol):
    """Where the trainer's rollouts come from, step by step (the default generates them in place;
    ``async`` receives them from the rollout ranks)."""

    def next(self, step: int) -> tuple[Any, Any, dict[str, float]]:
        """``(rollout, scores, reward metrics)`` for optimizer step ``step``: a
        :class:`~rlcore.rollout.base.RolloutBatch` of this rank's samples, their rewards ``[B]`` and
        the reward's metrics (``reward/...``)."""
        ...

    def data_state(self) -> Stateful:
        """The data position a checkpoint saved after the last returned step must hold, so that a
        resumed run draws exactly the prompts not yet trained on."""
        ...

    def metrics(self) -> dict[str, float]:
        """Numbers about the last :meth:`next` (e.g. ``async/staleness``); may be empty."""
        ...

    def close(self, failed: bool = False) -> None:
        """The run ended (completed, interrupted, or ``failed``: then a peer that cannot be reached is
        no further error): release peers and threads."""
        ...


@runtime_checkable
class WorldSplit(Protocol):
    """A plugin's answer to ``rlcore_world_split``: the last ``rollout_ranks`` ranks of the job generate."""

    rollout_ranks: int
    #: what the weights travel over from the trainers to the rollout ranks: ``gloo``, ``nccl`` or ``auto``
    weights_backend: str

    def run_rollout_rank(self, config: Any, split: Any) -> int:
        """The whole life of a rollout rank (``split`` is its :class:`~rlcore.distributed.split.SplitInfo`);
        returns the process's exit status."""
        ...

    def rollout_source(self, trainer: Any, split: Any) -> RolloutSource:
        """The source of rollouts of a training rank's trainer."""
        ...
