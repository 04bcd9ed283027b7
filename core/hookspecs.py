"""Hook specifications: every extension point of rlcore, grouped by phase.

Three shapes of hook:

* **factory** hooks build one component (``rlcore_dataset_provider`` …). Exactly one plugin answers:
  a selected plugin's answer wins over the built-in default's, and two selected plugins that both
  answer (return non-None) are an error naming both. Return ``None`` to pass.
* **registry** hooks receive a ``register`` callback and may call it any number of times.
* **event** hooks are broadcast to every plugin; their return values are ignored.

All arguments are keyword-only. An implementation may accept any subset of a spec's arguments,
so specs can grow without breaking plugins. Every implementation may also ask for ``settings``:
its own plugin's ``plugin_config.<name>`` section, checked against the dataclass the plugin
declares as ``settings_schema`` (see :mod:`rlcore.plugin_settings`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch.utils.data import Dataset

    from rlcore.config.schema import (
        DataConfig,
        FSDPConfig,
        RemeshingConfig,
        RewardConfig,
        RewardFunctionConfig,
        RewardModelConfig,
        TrainerConfig,
    )
    from rlcore.protocols import (
        CheckpointPolicy,
        DistInfo,
        PlacementPolicy,
        PlacementRequest,
        ReshardPolicy,
        RewardBackend,
        RolloutBackend,
        RolloutRequest,
        WorldSplit,
    )
    from rlcore.rollout.base import RolloutBatch

PROJECT = "rlcore"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Hooks that build a component; the plugin manager enforces "one answer".
FACTORY_HOOKS = (
    "rlcore_world_split",
    "rlcore_dataset_provider",
    "rlcore_placement_policy",
    "rlcore_reshard_policy",
    "rlcore_reward_backend",
    "rlcore_checkpoint_policy",
    "rlcore_rollout_backend",
)


# --------------------------------------------------------------------------------------------
# Checks before anything loads
# --------------------------------------------------------------------------------------------


@hookspec
def rlcore_preflight(config: dict[str, Any], plugins: list[str]) -> None:
    """Check this plugin's own needs before any data is read or model loads (``rlcore train`` and
    ``rlcore validate``): an optional library it imports, a service it reaches, a setting it requires.
    Raise an :class:`~rlcore.errors.RLCoreError` that names the plugin to stop the run; it is
    reported together with every other problem found before loading.

    :param config: the resolved configuration as a plain ``dict`` (read only).
    :param plugins: the names of the selected plugins.
    """


@hookspec
def rlcore_world_split(world_size: int, config: dict[str, Any]) -> Optional[WorldSplit]:
    """Split the job's ranks into a training group and a rollout group (``async``); the default
    answer trains on every rank (``rollout_ranks`` 0). Called by ``rlcore train`` once the workers
    run, before any process group starts.

    :param world_size: the number of processes the launcher started.
    :param config: the resolved configuration as a plain ``dict`` (read only).
    :returns: a :class:`~rlcore.protocols.WorldSplit`: how many of the last ranks generate, what those
        ranks run, and the trainer's source of rollouts; or ``None`` to pass.
    """


# --------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------


@hookspec
def rlcore_register_rewards(register: Callable[[str, Callable[..., Any]], None]) -> None:
    """Register named reward functions usable in ``reward.weights``.

    :param register: call ``register(name, fn)``; ``fn(prompts, responses, **extras) -> list[float]``
        (batched) or ``fn(prompt, response, **extras) -> float`` when ``fn.per_sample = True``.
    """


@hookspec
def rlcore_environment(register: Callable[[str, Callable[[dict], Any]], None]) -> None:
    """Register named environments for multi-turn rollouts; a dataset row picks one by name in its
    ``data.env_key`` column.

    :param register: call ``register(name, factory)``; ``factory(config)`` returns a fresh
        environment for one episode (see :class:`rlcore.envs.Environment`: ``start(row)`` and
        ``step(turn)``, plain or ``async``), ``config`` being ``plugin_config.<name>`` as a ``dict``
        without the rollout's own keys ``max_turns`` and ``max_tokens``. Raise ``ValueError`` naming
        the key for a bad setting.

    Life cycle: each episode gets its own instance, which receives ``start(row)`` once,
    ``step(turn)`` once per model turn and ``close()`` (where it has one) once when the episode ends.
    The start-up check (``rlcore train``, ``rlcore validate``) builds one instance per environment
    configured under ``plugin_config`` only to try its settings: it never receives ``start`` or
    ``step``, and its ``close()`` is called right after.
    """


@hookspec
def rlcore_tool_parser(register: Callable[[str, Callable[[str], Any]], None]) -> None:
    """Register named tool-call parsers, chosen by ``env.tool_parser``.

    :param register: call ``register(name, parser)``; ``parser(text)`` returns a
        :class:`rlcore.envs.ParsedTurn` (a malformed call is a :class:`rlcore.envs.ToolCallError`
        in it, never an exception).
    """


# --------------------------------------------------------------------------------------------
# Components (factory hooks)
# --------------------------------------------------------------------------------------------


@hookspec
def rlcore_dataset_provider(
    config: DataConfig, tokenizer: Any, split: str, dist: DistInfo
) -> Optional[Dataset]:
    """Build the prompt dataset of one split.

    Each item is a ``dict`` holding the prompt text under ``config.prompt_key`` and, optionally,
    ``input_ids`` (the trainer tokenizes rows without them) plus any extra columns, which reach
    the reward backend. A map-style or iterable dataset may be returned. An iterable dataset that
    shards itself over ``dist.rank``/``dist.world_size`` and DataLoader workers says so with a
    class attribute ``shards_itself = True``; any other iterable is split by the prompt loader,
    which gives each rank and worker every ``ranks x workers``-th row.

    :param config: the ``data`` section.
    :param tokenizer: the actor's tokenizer.
    :param split: ``"train"`` or ``"val"``.
    :param dist: rank and world size of this process.
    :returns: a ``torch.utils.data.Dataset`` / ``IterableDataset``, or None to pass.
    """


@hookspec
def rlcore_placement_policy(request: PlacementRequest, dist: DistInfo) -> Optional[PlacementPolicy]:
    """Decide where each role (actor, critic, ref, reward) lives.

    :param request: the device asked for per role and the rank groups of ``placement.rank_groups``.
    :param dist: rank, world size and the local device.
    :returns: a :class:`~rlcore.protocols.PlacementPolicy` (validated against the world size), or None.
        The trainer then refuses actor, critic or ref on a subset of the ranks.
    """


@hookspec
def rlcore_reshard_policy(
    fsdp: FSDPConfig, remeshing: RemeshingConfig, dist: DistInfo
) -> Optional[ReshardPolicy]:
    """Build the policy that lays the actor out for training and for generation.

    :param fsdp: the actor's effective FSDP settings.
    :param remeshing: the ``actor.remeshing`` section.
    :param dist: rank, world size and the local device.
    :returns: a :class:`~rlcore.protocols.ReshardPolicy`, or None.
    """


@hookspec
def rlcore_reward_backend(
    reward_model: RewardModelConfig,
    reward_function: RewardFunctionConfig,
    reward: RewardConfig,
    placement: PlacementPolicy,
    tokenizer: Any,
    rewards: dict[str, Callable[..., Any]],
    run_dir: str,
) -> Optional[RewardBackend]:
    """Build the scorer of rollouts.

    Called on the ranks that hold the reward role only: every rank, unless
    ``placement.rank_groups.reward`` names some, in which case the trainer sends the other ranks'
    samples to those ranks and their scores back.

    :param reward_model: the ``reward_model`` section.
    :param reward_function: the ``custom_reward_function`` section.
    :param reward: the ``reward`` section (weights, workers, timeouts, fallback score).
    :param placement: where the reward role lives.
    :param tokenizer: the actor's tokenizer (to decode or re-tokenize).
    :param rewards: named reward functions collected by :func:`rlcore_register_rewards`.
    :param run_dir: the run directory (``trainer.output_dir``), e.g. for a scorer's own log or cache.
    :returns: a :class:`~rlcore.protocols.RewardBackend`, or None.
    """


@hookspec
def rlcore_checkpoint_policy(trainer: TrainerConfig, dist: DistInfo) -> Optional[CheckpointPolicy]:
    """Build the policy deciding when to save, what to keep and how to resume.

    :param trainer: the ``trainer`` section (``save_steps``, ``save_total_limit``, ``resume``, ``output_dir`` …).
    :param dist: rank and world size.
    :returns: a :class:`~rlcore.protocols.CheckpointPolicy`, or None.
    """


@hookspec
def rlcore_rollout_backend(model: torch.nn.Module, request: RolloutRequest, dist: DistInfo) -> Optional[RolloutBackend]:
    """Build the generator of rollouts for ``model``.

    Called once per generation module the reshard policy yields (in a single process: once, for the
    training model, after the models load), inside the generation layout; afterwards the trainer
    calls ``sync_weights()`` before every rollout that follows an update. The built-in ``defaults``
    plugin answers with Hugging Face ``generate`` (``request.backend`` ``auto`` or ``hf``, and every
    tensor-parallel replica); the built-in ``engine`` plugin with the in-process engine for the models
    it supports (``auto`` or ``engine``). A backend plugin answers for its own name (``actor.rollout_backend``).
    Check it with :func:`rlcore.testing.check_rollout_backend`.

    :param model: the Hugging Face causal LM to generate with (the live training weights, or a
        gathered or tensor-parallel copy of them).
    :param request: ``actor.rollout_backend``, the largest batch and sequence, the engine's settings.
    :param dist: rank, world size and the local device.
    :returns: a :class:`~rlcore.protocols.RolloutBackend`, or None to pass.
    """


# --------------------------------------------------------------------------------------------
# Lifecycle events
# --------------------------------------------------------------------------------------------


@hookspec
def rlcore_train_start(run_dir: str, dist: DistInfo, config: dict[str, Any]) -> None:
    """Training is about to start (after models are loaded and resumed).

    :param run_dir: the run directory (``trainer.output_dir``).
    :param dist: rank and world size.
    :param config: the resolved configuration as a plain, read-only ``dict`` (for recording only).
    """


@hookspec
def rlcore_step_start(step: int) -> None:
    """An RL step begins.

    :param step: the 1-based step number.
    """


@hookspec
def rlcore_before_generation(step: int, prompts: list[list[int]]) -> None:
    """Rollout is about to start (once per rollout round: several times in a step when DAPO's dynamic
    sampling draws more prompts).

    :param step: the step number.
    :param prompts: prompt token ids, one list per sample.
    """


@hookspec
def rlcore_after_generation(step: int, rollout: RolloutBatch) -> None:
    """Rollout finished.

    :param step: the step number.
    :param rollout: the sampled batch.
    """


@hookspec
def rlcore_after_update(step: int, metrics: dict[str, float]) -> None:
    """The optimizer steps of this RL step are done.

    :param step: the step number.
    :param metrics: the update's metrics so far (losses, clip fractions, gradient norms).
    """


@hookspec
def rlcore_step_end(step: int, metrics: dict[str, float]) -> None:
    """An RL step ended; ``metrics`` is complete and may be extended by plugins in place.

    :param step: the step number.
    :param metrics: every metric of the step (timings in seconds under ``time/``).
    """


@hookspec
def rlcore_metrics(step: int, metrics: dict[str, float], split: str) -> None:
    """Metrics to record (the logging sink). Called every ``trainer.log_steps`` steps, at the last step and
    after every evaluation; ``rlcore_step_end`` sees every step's metrics.

    :param step: the step number.
    :param metrics: flat ``name -> value`` mapping.
    :param split: ``"train"`` or ``"val"``.
    """


@hookspec
def rlcore_train_end(step: int, status: str, summary: dict[str, float]) -> None:
    """Training ended.

    :param step: the last completed step.
    :param status: ``"completed"``, ``"interrupted"`` or ``"failed"``.
    :param summary: final evaluation numbers; an implementation may add to it in place (it is what
        ``Trainer.train`` returns). One that records it and wants every addition uses
        ``@hookimpl(trylast=True)``.
    """
