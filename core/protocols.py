"""The objects factory hooks return, as ``typing.Protocol`` classes, and the small value types they share.

A plugin's object need not inherit from these classes; it only needs the methods. Tests check
built-in plugins with ``isinstance`` (the protocols are ``runtime_checkable``).

Methods added to a protocol after its first release (:data:`OPTIONAL_METHODS`) have a default: a
plugin may inherit it from the protocol's base class (:class:`ReshardPolicyBase`,
:class:`CheckpointPolicyBase`, :class:`RolloutBackendBase` …); an answer written for an earlier
plugin API that lacks one gets the base class's default with a ``DeprecationWarning`` naming the
plugin (:func:`rlcore.plugin_manager.complete_answer`), so it keeps working. The plugin API's
version is :data:`rlcore.PLUGIN_API_VERSION`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

from rlcore.rollout.base import RolloutBackend, RolloutBatch, SamplingParams, slice_rollout

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


@dataclass(frozen=True)
class RolloutRequest:
    """What the trainer asks of a rollout backend (``rlcore_rollout_backend``)."""

    #: ``actor.rollout_backend``: ``auto``, ``engine``, ``hf`` or the name a backend plugin answers to.
    backend: str = "auto"
    #: the most prompts one ``generate`` call receives (``ppo.generation.batch_size``); None: not known.
    max_batch_size: Optional[int] = None
    #: the longest sequence, prompt plus new tokens (``data.max_prompt_length + ppo.generation.max_new_tokens``);
    #: None: not known.
    max_seq_len: Optional[int] = None
    #: ``actor.rollout_engine``: the built-in engine's settings.
    engine: Mapping[str, Any] = field(default_factory=dict)
    #: the model has DTensor weights (a tensor-parallel replica of the ``remesh`` plugin).
    tensor_parallel: bool = False
    #: bytes of device memory the training step will still allocate after the rollout (gradients and
    #: optimizer moments of the trainable weights not yet allocated): a backend that sizes a cache from
    #: the free memory leaves them out.
    memory_reserve_bytes: int = 0
    #: the run plays multi-turn episodes (``data.env_key``): prompts may carry an episode
    #: (:func:`rlcore.rollout.turns.play_episodes`); a backend that cannot play them says so with
    #: ``supports_episodes = False`` (the default) and the run is refused before any model loads.
    episodes: bool = False


@runtime_checkable
class PlacementPolicy(Protocol):
    """Decides where each role (actor, critic, ref, reward) lives.

    Checked when built (:func:`rlcore.contract.check_placement`): ``ranks_for`` gives whole numbers in
    ``[0, world_size)`` (at least one), ``device_for`` a device for each role this rank holds."""

    def device_for(self, role: str) -> torch.device:
        """The device on which ``role`` computes in this process."""
        ...

    def ranks_for(self, role: str) -> Sequence[int]:
        """The global ranks that hold ``role``."""
        ...

    def offload(self, role: str) -> bool:
        """Whether ``role``'s weights rest in CPU memory between uses."""
        ...


@dataclass(frozen=True)
class GenerationShare:
    """What one rank generates inside :meth:`ReshardPolicy.generation`: ``prompts`` sampled with
    ``params``; the rows ``rows = (start, stop)`` of the result are this rank's own (``None``: all)."""

    prompts: Sequence[Sequence[int]]
    params: SamplingParams
    rows: Optional[tuple[int, int]] = None

    def own(self, batch: RolloutBatch) -> RolloutBatch:
        """This rank's rows of ``batch`` (generated from :attr:`prompts`)."""
        return batch if self.rows is None else slice_rollout(batch, *self.rows)


@runtime_checkable
class ReshardPolicy(Protocol):
    """Switches the actor between its training layout and its generation layout.

    The trainer calls exactly these four methods: ``prepare`` once per trained role,
    then per rollout ``generation`` (a context manager) and, inside it, ``generation_share``;
    ``stats`` after every step. ``generation_share`` (plugin API 1.1) and ``prepare``'s ``fsdp``
    have defaults (:class:`ReshardPolicyBase`). Each share is checked
    (:func:`rlcore.contract.check_share`): it has ``prompts``, ``params`` and ``own()``, and the rows it
    keeps are one per prompt of this rank."""

    def prepare(self, model: torch.nn.Module, role: str, fsdp: Optional[FSDPConfig] = None) -> torch.nn.Module:
        """Wrap ``model`` for training (e.g. ``fully_shard``) and return the module to train.

        ``fsdp`` is the role's own effective sharding settings (``<role>.fsdp`` over the top-level
        ``fsdp``); ``None`` means the settings the policy was built with (the actor's)."""
        ...

    def generation(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """Context manager yielding a module that generates; on exit the training layout is restored."""
        ...

    def generation_share(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationShare:
        """Which prompts this rank generates (inside :meth:`generation`) and which rows of the result
        are its own. A policy where every rank generates its own prompts returns
        ``GenerationShare(prompts, params)``; one whose generation module spans several ranks pools
        their prompts (every rank of the group generates the pool with one seed) and names this rank's rows."""
        ...

    def stats(self) -> dict[str, float]:
        """Timing of the last switch (seconds), e.g. ``{"reshard/to_gen_s": ..., "reshard/to_train_s": ...}``."""
        ...


@dataclass
class RewardInput:
    """One batch to score. Lists have one entry per sample.

    ``prompts`` and ``responses`` are decoded alike: each from its own tokens (``prompt_ids``,
    ``response_ids``, without padding) by the actor's tokenizer with ``skip_special_tokens=True``, so
    special tokens (EOS, chat-template markers that are special tokens) are left out of both and
    spacing follows the tokenizer's decoder for both. The dataset's own prompt text, as written in
    the data, is in ``extras`` under ``data.prompt_key`` (with every other column of the row).
    """

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
    """Scores a batch of prompt/response pairs.

    ``score`` may be called several times per step, each time on a group of finished samples:
    with ``reward.stream`` (the default, in one process without a reward model) samples are scored
    in a worker thread as the rollout reports them finished, and whatever was not streamed once it
    ends; a backend must not assume one call holds the step's whole batch (or a whole group of
    ``ppo.generation.n``). Calls come one at a time, from that thread or the trainer's. The answer is
    checked every time (:func:`rlcore.contract.check_reward_output`): ``scores`` a 1-D tensor of one
    finite number per sample of ``batch``, in order, and ``metrics`` numbers by name. An optional
    ``close()`` is called once when the run ends (:class:`RewardBackendBase` has one)."""

    def score(self, batch: RewardInput) -> RewardOutput:
        """Return one finite score per sample; raise :class:`rlcore.errors.RewardError` otherwise."""
        ...


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@runtime_checkable
class CheckpointPolicy(Protocol):
    """When to save, what to keep, how to resume.

    ``wait`` (plugin API 1.1) has a default (:class:`CheckpointPolicyBase`). ``resume``'s answer is
    checked (:func:`rlcore.contract.check_resume_step`: a whole number >= 0)."""

    def should_save(self, step: int, *, final: bool = False) -> bool:
        """Whether to save after optimizer step ``step``; ``final=True`` is asked once when the run
        ends (completed or interrupted), after the last step. The default policy answers yes to it
        (a run always leaves a resumable checkpoint); a policy may answer no."""
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

    def wait(self) -> None:
        """Block until every save started so far has landed (a policy that saves synchronously
        returns at once). Called before the run ends."""
        ...


@runtime_checkable
class RolloutSource(Protocol):
    """Where the trainer's rollouts come from, step by step (the default generates them in place;
    ``async`` receives them from the rollout ranks)."""

    def next(self, step: int) -> Any:
        """This rank's scored samples of optimizer step ``step``: a :class:`~rlcore.trainer.sampled.Sampled`
        (the rollout, its scores, truncation flags and group ids, the reward's metrics)."""
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

    def run_rollout_rank(self, config: Any, split: Any, pm: Any) -> int:
        """The whole life of a rollout rank (``split`` is its :class:`~rlcore.distributed.split.SplitInfo`,
        ``pm`` the run's plugin manager, which builds its rollout backend); returns the process's exit status."""
        ...

    def rollout_source(self, trainer: Any, split: Any) -> RolloutSource:
        """The source of rollouts of a training rank's trainer."""
        ...


# ------------------------------------------------------------------------------------------------
# Base classes: the defaults of the methods added after a protocol's first release
# ------------------------------------------------------------------------------------------------


class PlacementPolicyBase:
    """A base a placement policy may inherit (nothing of it is optional yet)."""


class ReshardPolicyBase:
    """A base a reshard policy may inherit: the defaults of :meth:`ReshardPolicy.generation_share`
    (every rank generates its own prompts) and :meth:`ReshardPolicy.stats` (no timings)."""

    def generation_share(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationShare:
        return GenerationShare(prompts, params)

    def stats(self) -> dict[str, float]:
        return {}


class CheckpointPolicyBase:
    """A base a checkpoint policy may inherit: the default of :meth:`CheckpointPolicy.wait` (a policy
    that saves synchronously has nothing to wait for)."""

    def wait(self) -> None:
        return None


class RewardBackendBase:
    """A base a reward backend may inherit: ``close()`` releases nothing."""

    def close(self) -> None:
        return None


class RolloutBackendBase:
    """A base a rollout backend may inherit: it plays no multi-turn episodes (``supports_episodes``
    False: a run with ``data.env_key`` is refused before any model loads) and ``close()`` releases
    nothing. A backend that plays episodes sets ``supports_episodes = True`` and plays prompts that
    carry one with :func:`rlcore.rollout.turns.play_episodes`."""

    supports_episodes: bool = False

    def close(self) -> None:
        return None


#: Per protocol, the methods added after its first release, each with the plugin API version that
#: added it: an answer without one gets the default of the protocol's base class (:data:`BASES`).
OPTIONAL_METHODS: dict[str, dict[str, str]] = {
    "ReshardPolicy": {"generation_share": "1.1"},
    "CheckpointPolicy": {"wait": "1.1"},
}

#: Per protocol, keyword parameters added to a method after its first release: an answer whose
#: method lacks one is called without it (``ReshardPolicy.prepare(fsdp=)``: the policy keeps the
#: settings it was built with for every role).
OPTIONAL_PARAMETERS: dict[str, dict[str, tuple[str, str]]] = {
    "ReshardPolicy": {"prepare": ("fsdp", "1.1")},
}

#: The base class holding each protocol's defaults.
BASES: dict[str, type] = {"PlacementPolicy": PlacementPolicyBase, "ReshardPolicy": ReshardPolicyBase,
                          "CheckpointPolicy": CheckpointPolicyBase, "RewardBackend": RewardBackendBase,
                          "RolloutBackend": RolloutBackendBase}


__all__ = ["BASES", "CheckpointPolicy", "CheckpointPolicyBase", "DistInfo", "GenerationShare", "OPTIONAL_METHODS",
           "OPTIONAL_PARAMETERS", "PlacementPolicy", "PlacementPolicyBase", "PlacementRequest", "ReshardPolicy",
           "ReshardPolicyBase", "RewardBackend", "RewardBackendBase", "RewardInput", "RewardOutput",
           "RolloutBackend", "RolloutBackendBase", "RolloutRequest", "RolloutSource", "Stateful", "WorldSplit"]

