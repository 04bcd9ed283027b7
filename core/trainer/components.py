"""Assembling one run: models, optimizers and every plugin-built component, each from its own config section."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from rlcore import rlmath
from rlcore.config.schema import resolve_fsdp, trains_critic
from rlcore.protocols import DistInfo, PlacementRequest
from rlcore.rollout.base import RolloutBatch, SamplingParams
from rlcore.trainer import models

log = logging.getLogger(__name__)


def obj(node: Any) -> Any:
    """The typed dataclass object of a config section (what a component receives)."""
    return OmegaConf.to_object(node)


@dataclass
class Components:
    tokenizer: Any
    actor: torch.nn.Module
    actor_module: torch.nn.Module
    actor_opt: Any
    actor_sched: Any
    ref: Optional[torch.nn.Module]
    critic: Optional[torch.nn.Module]
    critic_opt: Any
    critic_sched: Any
    kl_ctrl: Any
    backends: Any
    micro: Any
    reward: Any
    checkpoint: Any
    reshard: Any
    placement: Any
    train_loader: Any
    val_rows: list
    ensure_ids: Any  # rlcore.data.collate.BatchFiller: fills each batch; its state is the data position
    gpu_monitor: Any
    profiler: Any
    train_device: torch.device
    micro_batch: int
    eos_ids: list[int]
    rng: Any
    world_size: int = 1
    extra_state: dict = field(default_factory=dict)

    def stateful(self, trainer_state: Any) -> dict[str, Any]:
        state = {"actor": self.actor, "actor_optim": self.actor_opt, "actor_sched": self.actor_sched,
                 "kl_ctrl": self.kl_ctrl, "trainer": trainer_state, "rng": self.rng,
                 # the loader's position, with the rows the batch filler carries into the next batch
                 "data": self.ensure_ids}
        if self.critic is not None:
            state.update(critic=self.critic, critic_optim=self.critic_opt, critic_sched=self.critic_sched)
        return state

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        """Switch the actor to its generation layout, generate (split over replicas by the reshard
        policy, micro-batched with out-of-memory back-off) and switch back."""
        with self.reshard.generation(self.actor) as gen_module:
            gen_module.eval()
            backend = self.backends.get(gen_module)
            return self.reshard.generate_distributed(
                lambda p, sp: self.micro.generate(backend.generate, p, sp), prompts, params)

    def graceful_exit(self):
        from rlcore.trainer.checkpoint import GracefulExit

        return GracefulExit()

    @contextlib.contextmanager
    def progress(self, start: int, total: int) -> Iterator[Any]:
        from rlcore.observe.progress import ProgressBar

        bar = ProgressBar(start, total, enabled=self._progress_enabled)
        try:
            yield bar
        finally:
            bar.close()

    _progress_enabled: bool = True

    def perf_metrics(self, rollout: RolloutBatch, step_s: float) -> dict[str, float]:
        tokens = float(rollout.prompt_mask.sum() + rollout.response_mask.sum())
        out = {"perf/tokens_per_s": tokens * self.world_size / step_s, "perf/tokens_per_s_per_gpu": tokens / step_s}
        try:
            from rlcore.observe.flops import estimate_flops, peak_flops

            peak = peak_flops(self.train_device)
            if peak:
                seq = rollout.prompt_ids.shape[1] + rollout.response_ids.shape[1]
                out["perf/mfu"] = estimate_flops(self.actor_module.config, tokens, seq) / step_s / peak
        except ImportError:
            pass
        if self.train_device.type == "cuda":
            out["memory/peak_gb"] = torch.cuda.max_memory_allocated(self.train_device) / 2**30
        return out

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        if self.world_size <= 1:
            return metrics
        from rlcore.distributed.init import all_reduce_mean

        return all_reduce_mean(metrics)


def _load_rows(dataset: Any, limit: int) -> list:
    """The first ``limit`` rows of the held-out set (``trainer.eval_samples``); says so when there are more."""
    rows = []
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        if len(dataset) > limit:
            log.info("evaluation uses the first %d of %d held-out prompts (trainer.eval_samples)", limit, len(dataset))
        for i in range(min(limit, len(dataset))):
            rows.append(dataset[i])
    else:
        for row in dataset:
            rows.append(row)
            if len(rows) >= limit:
                break
    return rows


def build_placement(pm: Any, dist: DistInfo, actor_cfg: Any, critic_cfg: Any, reward_model_cfg: Any,
                    placement_cfg: Any, uses_critic: bool = True) -> Any:
    """The placement policy for the role devices and ``placement.rank_groups``, checked against the
    world size and against what the trainer runs (only ``reward`` may be split).

    :raises PlacementError: a device that does not exist, rank groups that do not fit the world, or
        actor, critic or ref on a subset of the ranks.
    """
    from rlcore.distributed.placement import check_trainer_placement, requested_devices

    devices = requested_devices(actor_cfg, critic_cfg, reward_model_cfg, uses_critic)
    placement = pm.build("rlcore_placement_policy", request=PlacementRequest(
        **devices, reward_offload=bool(reward_model_cfg.offload),
        rank_groups={role: list(ranks) for role, ranks in placement_cfg.rank_groups.items()}), dist=dist)
    check_trainer_placement(placement, dist.world_size)
    return placement


def build_reward(cfg: DictConfig, pm: Any, placement: Any, tokenizer: Any, dist: DistInfo) -> Any:
    """This rank's reward backend from the ``rlcore_reward_backend`` hook. With the reward role on a
    subset of the ranks, only those ranks build it (and load the reward model); every rank gets a
    :class:`~rlcore.rewards.routed.RoutedReward` that scores its samples there."""
    from rlcore.rewards.routed import build_routed_reward

    reward_cfg = obj(cfg.reward)
    if cfg.data.env_key and not reward_cfg.weights and not cfg.custom_reward_function.path \
            and not cfg.reward_model.enable:
        reward_cfg.weights = {"env_reward": 1.0}  # multi-turn episodes: the environments' rewards by default

    def build() -> Any:
        rewards: dict[str, Any] = {}
        pm.hook.rlcore_register_rewards(register=lambda name, fn: rewards.__setitem__(name, fn))
        return pm.build("rlcore_reward_backend", reward_model=obj(cfg.reward_model),
                        reward_function=obj(cfg.custom_reward_function), reward=reward_cfg,
                        placement=placement, tokenizer=tokenizer, rewards=rewards)

    return build_routed_reward(build, placement, dist)


def build_episode_runner(cfg: DictConfig, pm: Any, tokenizer: Any) -> Any:
    """The runner of multi-turn episodes when ``data.env_key`` is set (else ``None``): every
    environment and tool-call parser the plugins register, configured by ``plugin_config`` and
    the ``env`` section."""
    if not cfg.data.env_key:
        return None
    from rlcore.envs.runner import EpisodeLimits, EpisodeRunner, collect_environments
    from rlcore.errors import ConfigError

    if cfg.actor.remeshing.enabled:
        raise ConfigError(["'data.env_key' (multi-turn episodes) does not work with 'actor.remeshing.enabled': "
                           "generation groups pool prompts across ranks as plain token ids"])
    env = obj(cfg.env)
    max_tokens = min(env.max_tokens or cfg.ppo.generation.max_new_tokens, cfg.ppo.generation.max_new_tokens)
    environments = collect_environments(pm, OmegaConf.to_container(cfg.plugin_config, resolve=True),
                                        env.tool_parser, EpisodeLimits(env.max_turns, max_tokens, env.timeout_s))
    return EpisodeRunner(environments, tokenizer, env.max_concurrency, env.stop)


def build_components(cfg: DictConfig, pm: Any, dist: DistInfo) -> Components:
    """Load models and build every component. Only this function reads across sections."""
    data_cfg, actor_cfg, critic_cfg = obj(cfg.data), obj(cfg.actor), obj(cfg.critic)
    tcfg, ppo, algo = obj(cfg.trainer), obj(cfg.ppo), obj(cfg.algorithm)
    torch.manual_seed(tcfg.seed)

    # Placement first: a layout that does not fit the world fails before anything loads.
    placement = build_placement(pm, dist, actor_cfg, critic_cfg, obj(cfg.reward_model), obj(cfg.placement),
                                uses_critic=trains_critic(algo.adv_estimator))
    device = placement.device_for("actor")
    model_path = actor_cfg.model_path or _demo_model(tcfg.output_dir, dist)
    if not actor_cfg.model_path and (data_cfg.train_files or data_cfg.custom_cls.path) and dist.is_main:
        log.warning("actor.model_path is not set: the policy is the demo's tiny model (%s, a word tokenizer of "
                    "the demo's 12 letters) trained on your data; set actor.model_path to a Hugging Face model "
                    "directory to train your own", model_path)
    tokenizer = models.load_tokenizer(model_path)

    # Data next: bad input fails before the (expensive) models load.
    loader, val_rows, ensure = _build_data(pm, data_cfg, tcfg, ppo, tokenizer, device, model_path, dist)

    # Reward and checkpoint policies next: a bad reward model path fails before the actor loads.
    reward = build_reward(cfg, pm, placement, tokenizer, dist)
    checkpoint = pm.build("rlcore_checkpoint_policy", trainer=tcfg, dist=dist)
    actor_fsdp = resolve_fsdp(obj(cfg.fsdp), actor_cfg.fsdp)
    reshard = pm.build("rlcore_reshard_policy", fsdp=actor_fsdp, remeshing=actor_cfg.remeshing, dist=dist)

    actor_module, ref, critic = _load_models(cfg, model_path, device, placement, actor_fsdp, dist)
    actor = reshard.prepare(actor_module, "actor")
    if ref is not None and dist.distributed:
        ref = reshard.prepare(ref, "ref")  # sharded like the actor instead of a full copy per rank
    if critic is not None:
        critic = prepare_role(reshard, critic, "critic", resolve_fsdp(obj(cfg.fsdp), critic_cfg.fsdp), actor_fsdp)
    n = int(ppo.rollout_batch_size) * ppo.generation.n
    total = tcfg.max_steps * ppo.ppo_epochs * max(1, n // max(1, ppo.mini_batch_size or 10**9))
    actor_opt, actor_sched = models.build_optimizer(actor, actor_cfg, total)
    critic_opt = critic_sched = None
    if critic is not None:
        critic_opt, critic_sched = models.build_optimizer(critic, critic_cfg, total)
    kl_ctrl = rlmath.make_kl_controller(ppo.kl_ctrl, ppo.kl_coeff, ppo.kl_target, ppo.kl_horizon)

    from rlcore.observe.gpu import GPUMonitor
    from rlcore.observe.profiler import StepProfiler
    from rlcore.rollout.autosize import AdaptiveMicroBatch
    from rlcore.trainer.checkpoint import RNGState
    from rlcore.trainer.update import Batching

    eos = tokenizer.eos_token_id
    comps = Components(
        tokenizer=tokenizer, actor=actor, actor_module=actor_module, actor_opt=actor_opt, actor_sched=actor_sched,
        ref=ref, critic=critic, critic_opt=critic_opt, critic_sched=critic_sched, kl_ctrl=kl_ctrl,
        backends=_generation_backends(actor, actor_module, actor_cfg, data_cfg, ppo, dist),
        micro=AdaptiveMicroBatch(int(ppo.generation.batch_size)), reward=reward, checkpoint=checkpoint,
        reshard=reshard, placement=placement, train_loader=loader, val_rows=val_rows, ensure_ids=ensure,
        gpu_monitor=GPUMonitor(tcfg.gpu_monitor_interval if tcfg.gpu_monitor else 0.0),
        profiler=StepProfiler(tcfg.enable_profiling, tcfg.profile_steps, tcfg.output_dir, dist.rank),
        train_device=device, micro_batch=Batching.from_config(n, ppo, tcfg.gradient_accumulation_steps).micro,
        eos_ids=[eos] if isinstance(eos, int) else list(eos or []), rng=RNGState(), world_size=dist.world_size)
    comps._progress_enabled = bool(tcfg.progress) and dist.is_main
    return comps


def _build_data(pm: Any, data_cfg: Any, tcfg: Any, ppo: Any, tokenizer: Any, device: torch.device,
                model_path: str, dist: DistInfo) -> tuple[Any, list, Callable]:
    """``(train loader, held-out rows, ensure_ids)``, ``ensure_ids`` filling each training batch from the
    loader's; sizes ``ppo.rollout_batch_size=auto`` first."""
    from rlcore.data.collate import BatchFiller, ensure_input_ids
    from rlcore.data.loader import PromptLoader

    train_ds = pm.build("rlcore_dataset_provider", config=data_cfg, tokenizer=tokenizer, split="train", dist=dist)
    val_rows: list = []
    if data_cfg.val_files or not data_cfg.train_files:
        val_ds = pm.build("rlcore_dataset_provider", config=data_cfg, tokenizer=tokenizer, split="val", dist=dist)
        val_rows = _load_rows(val_ds, tcfg.eval_samples)
    val_rows = ensure_input_ids(val_rows, tokenizer, data_cfg, drop_overlong=True) if val_rows else []
    if ppo.rollout_batch_size == "auto":
        from rlcore.rollout.autosize import auto_rollout_batch_size

        ppo.rollout_batch_size = auto_rollout_batch_size(device=device, n=ppo.generation.n, model_path=model_path,
                                                         max_len=data_cfg.max_prompt_length + ppo.generation.max_new_tokens)
    loader = PromptLoader(train_ds, data_cfg, int(ppo.rollout_batch_size), tcfg.seed, dist)
    loader.check_first_batch()  # an iterable set too small for one batch fails before the models load
    return loader, val_rows, BatchFiller(loader, tokenizer, data_cfg, int(ppo.rollout_batch_size))


def _wants_compile(setting: Optional[bool], device: torch.device | str) -> bool:
    """``<role>.compile``: as set, or (``null``) on for a role that trains on CUDA."""
    return bool(setting) if setting is not None else torch.device(device).type == "cuda"


def prepare_role(reshard: Any, model: torch.nn.Module, role: str, fsdp: Any, policy_fsdp: Any) -> torch.nn.Module:
    """``reshard.prepare`` with the role's own FSDP settings; a policy whose ``prepare`` takes no
    ``fsdp`` argument (written before it existed) keeps its own, with a warning when they differ."""
    import inspect

    if "fsdp" in inspect.signature(reshard.prepare).parameters:
        return reshard.prepare(model, role, fsdp=fsdp)
    if fsdp != policy_fsdp:
        log.warning("the reshard policy %s takes no per-role FSDP settings: %s is sharded with the actor's "
                    "(%s) instead of its own (%s)", type(reshard).__name__, role, policy_fsdp, fsdp)
    return reshard.prepare(model, role)


def _load_models(cfg: DictConfig, model_path: str, device: torch.device, placement: Any, actor_fsdp: Any,
                 dist: DistInfo) -> tuple[torch.nn.Module, Optional[torch.nn.Module], Optional[torch.nn.Module]]:
    """``(actor, frozen reference or None, critic or None)``, full (not yet sharded) models, with
    gradient checkpointing and compiled layers as configured."""
    from rlcore.distributed.fsdp import compile_layers, enable_gradient_checkpointing, load_model_for_role

    actor_cfg, critic_cfg, ppo, algo = obj(cfg.actor), obj(cfg.critic), obj(cfg.ppo), obj(cfg.algorithm)
    actor = load_model_for_role(lambda: models.load_causal_lm(model_path, actor_cfg.dtype, device), actor_fsdp, dist)
    if actor_cfg.gradient_checkpointing:
        enable_gradient_checkpointing(actor)
    ref = models.frozen_copy(actor) if algo.use_reference and ppo.kl_coeff > 0 else None
    critic = None
    if trains_critic(algo.adv_estimator):
        critic_path = critic_cfg.model_path or model_path
        base = load_model_for_role(
            lambda: models.load_causal_lm(critic_path, critic_cfg.dtype, placement.device_for("critic")),
            resolve_fsdp(obj(cfg.fsdp), critic_cfg.fsdp), dist)
        critic = models.ValueModel.from_causal_lm(base)
    if _wants_compile(actor_cfg.compile, device):  # after the reference copy: the reference runs uncompiled
        compile_layers(actor, "actor", fallback=actor_cfg.compile is None)
    if critic is not None and _wants_compile(critic_cfg.compile, placement.device_for("critic")):
        compile_layers(critic, "critic", fallback=critic_cfg.compile is None)
    return actor, ref, critic


def _generation_backends(actor: Any, actor_module: torch.nn.Module, actor_cfg: Any, data_cfg: Any, ppo: Any,
                         dist: DistInfo) -> Any:
    """The rollout backends of the actor's generation layouts (built on first use)."""
    from rlcore.distributed.reshard import GenerationBackends
    from rlcore.rollout import make_backend

    engine_kw = dict(actor_cfg.rollout_engine, max_batch_size=ppo.generation.batch_size,
                     max_seq_len=data_cfg.max_prompt_length + ppo.generation.max_new_tokens)
    prebuilt = {}
    if not dist.distributed:  # single process: the backend reads the training module directly
        prebuilt[id(actor)] = make_backend(actor_module, actor_cfg.rollout_backend, **engine_kw)
    return GenerationBackends(lambda module, kind: make_backend(module, kind, **engine_kw),
                              actor_cfg.rollout_backend, prebuilt=prebuilt)


def _demo_model(output_dir: str, dist: DistInfo) -> str:
    from rlcore.demo import ensure_demo_model

    root = os.path.join(output_dir, "_demo")
    # Building the model draws from the global RNG: fork it so a first run (which builds) and a
    # later one (which loads) train from the same random state.
    with torch.random.fork_rng(devices=[]):
        if dist.is_main:
            ensure_demo_model(root)
    if dist.distributed:
        torch.distributed.barrier()
    return ensure_demo_model(root)
