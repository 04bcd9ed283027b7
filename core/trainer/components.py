"""Assembling one run: models, optimizers and every plugin-built component, each from its own config section."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from omegaconf import DictConfig, OmegaConf

from rlcore import rlmath
from rlcore.config.schema import resolve_fsdp, trains_critic
from rlcore.data.collate import BatchFiller
from rlcore.data.loader import PromptLoader
from rlcore.errors import ConfigError, PluginError
from rlcore.protocols import CheckpointPolicy, DistInfo, PlacementPolicy, PlacementRequest, ReshardPolicy
from rlcore.protocols import RewardBackend, RolloutBackend, Stateful
from rlcore.trainer import models, sdpa
from rlcore.trainer.checkpoint import RNGState
from rlcore.trainer.generation import ActorGeneration, rollout_request  # noqa: F401 - read here too

log = logging.getLogger(__name__)


def obj(node: Any) -> Any:
    """The typed dataclass object of a config section (what a component receives)."""
    return OmegaConf.to_object(node)


@dataclass
class Trained:
    """A role the run trains: the model as the reshard policy prepared it, its optimizer and LR schedule."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


@dataclass
class Prompts:
    """Where prompts come from: the training loader, the batch filler over it (its state is the data
    position) and the held-out rows (``trainer.eval_samples`` of them)."""

    loader: PromptLoader
    fill: BatchFiller
    val_rows: list[dict[str, Any]]


@dataclass
class Built:
    """Every factory answer built for one run, each once, with the plugin that answered it: the
    trainer uses these instances and :meth:`close` releases them when the run ends (or when building
    the rest fails)."""

    answers: list[tuple[str, str, Any]] = field(default_factory=list)

    def add(self, role: str, named: tuple[str, Any]) -> Any:
        """Record ``(plugin, answer)`` built for ``role``; return the answer."""
        self.answers.append((role, named[0], named[1]))
        return named[1]

    def plugin(self, role: str, default: str = "") -> str:
        """The plugin that answered for ``role`` (``default``, else the role, when none was built here)."""
        return next((name for r, name, _ in self.answers if r == role), default or role)

    def close(self) -> None:
        """``close()`` every answer that has one, the last built first, each once."""
        from rlcore.plugin_manager import close_answer

        seen: set[int] = set()
        for _, _, answer in reversed(self.answers):
            if id(answer) not in seen:
                seen.add(id(answer))
                close_answer(answer)
        self.answers.clear()


@dataclass
class Components:
    """The parts of one run, each built from its own config section by :func:`build_components`."""

    tokenizer: Any  # a Hugging Face tokenizer
    #: the unwrapped Hugging Face causal LM of the actor (its config, export, FLOP count)
    policy: torch.nn.Module
    actor: Trained
    critic: Optional[Trained]
    ref: Optional[torch.nn.Module]
    kl_ctrl: rlmath.KLController
    prompts: Prompts
    generation: ActorGeneration
    reward: RewardBackend
    checkpoint: CheckpointPolicy
    reshard: ReshardPolicy
    placement: PlacementPolicy
    rng: RNGState
    train_device: torch.device
    #: rows per forward pass when computing log-probs and values
    micro_batch: int
    eos_ids: list[int]
    #: whether the training forwards pack their sequences (``ppo.pack_sequences`` resolved)
    packed: bool = False
    #: per trained role, its activation-checkpointing policy (:class:`rlcore.trainer.recompute.Recompute`)
    recompute: dict[str, Any] = field(default_factory=dict)
    #: the factory answers built for the run and the plugins that answered
    built: Built = field(default_factory=Built)

    def close(self) -> None:
        """Release every factory answer the run built: the rollout backends, then the rest (``close()``
        where an answer has one)."""
        self.generation.close()
        self.built.close()

    def stateful(self, trainer_state: Stateful) -> dict[str, Stateful]:
        state = {"actor": self.actor.model, "actor_optim": self.actor.optimizer, "actor_sched": self.actor.scheduler,
                 "kl_ctrl": self.kl_ctrl, "trainer": trainer_state, "rng": self.rng,
                 # the loader's position, with the rows the batch filler carries into the next batch
                 "data": self.prompts.fill}
        if self.critic is not None:
            state.update(critic=self.critic.model, critic_optim=self.critic.optimizer,
                         critic_sched=self.critic.scheduler)
        return state


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
                    placement_cfg: Any, uses_critic: bool = True, built: Optional[Built] = None) -> Any:
    """The placement policy for the role devices and ``placement.rank_groups``, checked against the
    world size and against what the trainer runs (only ``reward`` may be split); recorded in ``built``.

    :raises PlacementError: a device that does not exist, rank groups that do not fit the world, or
        actor, critic or ref on a subset of the ranks.
    :raises PluginError: a device or ranks the policy answers that are none (:func:`rlcore.contract.check_placement`).
    """
    from rlcore.contract import check_placement
    from rlcore.distributed.placement import check_trainer_placement, requested_devices

    devices = requested_devices(actor_cfg, critic_cfg, reward_model_cfg, uses_critic)
    name, placement = pm.build_named("rlcore_placement_policy", request=PlacementRequest(
        **devices, reward_offload=bool(reward_model_cfg.offload),
        rank_groups={role: list(ranks) for role, ranks in placement_cfg.rank_groups.items()}), dist=dist)
    (built if built is not None else Built()).add("placement", (name, placement))
    check_placement(placement, list(devices), dist, name)
    check_trainer_placement(placement, dist.world_size)
    return placement


def build_reward(cfg: DictConfig, pm: Any, placement: Any, tokenizer: Any, dist: DistInfo,
                 built: Optional[Built] = None) -> Any:
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
        return (built if built is not None else Built()).add("reward", pm.build_named(
            "rlcore_reward_backend", reward_model=obj(cfg.reward_model),
            reward_function=obj(cfg.custom_reward_function), reward=reward_cfg, placement=placement,
            tokenizer=tokenizer, rewards=rewards, run_dir=cfg.trainer.output_dir))

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
    from rlcore.envs.builtin import with_sandbox_mode

    plugin_config = with_sandbox_mode(OmegaConf.to_container(cfg.plugin_config, resolve=True), env.python.sandbox)
    environments = collect_environments(pm, plugin_config, env.tool_parser,
                                        EpisodeLimits(env.max_turns, max_tokens, env.timeout_s,
                                                      env.max_observation_chars))
    return EpisodeRunner(environments, tokenizer, env.max_concurrency, env.stop)


def build_components(cfg: DictConfig, pm: Any, dist: DistInfo) -> Components:
    """Load models and build every component, each factory answer once (:class:`Built`); what was
    built is closed again when building the rest fails. Only this function reads across sections."""
    built = Built()
    try:
        return _build_components(cfg, pm, dist, built)
    except BaseException:
        built.close()
        raise


def _build_components(cfg: DictConfig, pm: Any, dist: DistInfo, built: Built) -> Components:
    data_cfg, actor_cfg, critic_cfg = obj(cfg.data), obj(cfg.actor), obj(cfg.critic)
    if not actor_cfg.model_path:  # `rlcore train` fills it in (the demo's model) before the trainer is built
        raise ConfigError(["actor.model_path is not set: the trainer needs the policy's Hugging Face model "
                           "directory (rlcore.demo.use_demo_model(cfg, dist) sets the demo's tiny model, as "
                           "`rlcore train` does)"])
    tcfg, ppo, algo = obj(cfg.trainer), obj(cfg.ppo), obj(cfg.algorithm)
    torch.manual_seed(tcfg.seed)

    # Placement first: a layout that does not fit the world fails before anything loads.
    placement = build_placement(pm, dist, actor_cfg, critic_cfg, obj(cfg.reward_model), obj(cfg.placement),
                                uses_critic=trains_critic(algo.adv_estimator), built=built)
    device = placement.device_for("actor")
    switches = sdpa.apply(tcfg.sdpa_backends, device)
    if switches is not None:  # put back when the run ends
        built.add("sdpa", ("trainer.sdpa_backends", switches))
    model_path = actor_cfg.model_path
    tokenizer = models.load_tokenizer(model_path)

    # Data, reward, checkpoint and reshard policies before the (expensive) models load: a bad input or
    # reward model path fails first, and every plugin's wrong answer among them is reported together.
    problems: list[PluginError] = []

    def attempt(build: Any) -> Any:
        try:
            return build()
        except PluginError as error:
            problems.append(error)
            return None

    prompts = attempt(lambda: _build_data(pm, data_cfg, tcfg, ppo, tokenizer, device, model_path, dist, built))
    reward = attempt(lambda: build_reward(cfg, pm, placement, tokenizer, dist, built))
    checkpoint = attempt(lambda: built.add("checkpoint", pm.build_named("rlcore_checkpoint_policy", trainer=tcfg,
                                                                        dist=dist)))
    actor_fsdp = resolve_fsdp(obj(cfg.fsdp), actor_cfg.fsdp)
    reshard = attempt(lambda: built.add("reshard", pm.build_named("rlcore_reshard_policy", fsdp=actor_fsdp,
                                                                  remeshing=actor_cfg.remeshing, dist=dist)))
    if len(problems) > 1:
        from rlcore.errors import PreflightError

        raise PreflightError(problems)
    if problems:
        raise problems[0]

    actor_module, ref, critic = _load_models(cfg, model_path, device, placement, actor_fsdp, dist)
    actor, ref, critic = _prepared(reshard, actor_module, ref, critic, cfg, dist)
    n = int(ppo.rollout_batch_size) * ppo.generation.n
    total = tcfg.max_steps * ppo.ppo_epochs * max(1, n // max(1, ppo.mini_batch_size or 10**9))
    actor_opt, actor_sched = models.build_optimizer(actor, actor_cfg, total)
    critic_opt = critic_sched = None
    if critic is not None:
        critic_opt, critic_sched = models.build_optimizer(critic, critic_cfg, total)
    kl_ctrl = rlmath.make_kl_controller(ppo.kl_ctrl, ppo.kl_coeff, ppo.kl_target, ppo.kl_horizon)

    from rlcore.trainer.packing_check import resolve_packing
    from rlcore.trainer.update import Batching

    for model in (actor, ref):
        if model is not None:
            models.set_logprob_head(model, str(ppo.logprob_head))
    recompute = {"actor": _recompute(actor, actor_module.config, actor_cfg, device, "actor",
                                     logits=models.fused_head(actor, device) is None)}
    if critic is not None:
        recompute["critic"] = _recompute(critic, critic.config, critic_cfg, placement.device_for("critic"), "critic")
    eos = tokenizer.eos_token_id
    return Components(
        tokenizer=tokenizer, policy=actor_module, actor=Trained(actor, actor_opt, actor_sched),
        critic=Trained(critic, critic_opt, critic_sched) if critic is not None else None, ref=ref, kl_ctrl=kl_ctrl,
        prompts=prompts, generation=_generation(pm, actor, actor_module, reshard, actor_cfg, data_cfg, ppo, dist,
                                                trained=[(actor, actor_opt)] + ([(critic, critic_opt)] if critic is not None
                                                                                 and placement.device_for("critic") == device
                                                                                 else []),
                                                reshard_plugin=built.plugin("reshard")),
        reward=reward, checkpoint=checkpoint, reshard=reshard, placement=placement, rng=RNGState(),
        train_device=device, micro_batch=Batching.from_config(n, ppo, tcfg.gradient_accumulation_steps).micro,
        eos_ids=[eos] if isinstance(eos, int) else list(eos or []),
        packed=resolve_packing(ppo.pack_sequences, [actor, critic]), recompute=recompute, built=built)


def _prepared(reshard: ReshardPolicy, actor: torch.nn.Module, ref: Optional[torch.nn.Module],
              critic: Optional[torch.nn.Module], cfg: DictConfig, dist: DistInfo) -> tuple[Any, Any, Any]:
    """The loaded models as the reshard policy prepares them for training: the actor; the reference as
    the actor with its adapters off (LoRA), sharded like the actor (several processes) or as loaded; the
    critic with its own FSDP settings."""
    actor = reshard.prepare(actor, "actor")
    if ref is not None and cfg.actor.lora.rank > 0:
        from rlcore.trainer.lora import AdaptersDisabled

        ref = AdaptersDisabled(actor)  # the (sharded) actor with its adapters off: no second copy
    elif ref is not None and dist.distributed:
        ref = reshard.prepare(ref, "ref")  # sharded like the actor instead of a full copy per rank
    if critic is not None:
        critic = reshard.prepare(critic, "critic", fsdp=resolve_fsdp(obj(cfg.fsdp), obj(cfg.critic).fsdp))
    return actor, ref, critic


def _recompute(model: torch.nn.Module, config: Any, role_cfg: Any, device: torch.device, role: str,
               logits: bool = True) -> Any:
    """The role's :class:`~rlcore.trainer.recompute.Recompute` (``<role>.gradient_checkpointing`` and its
    policy); ``logits``: the role's log-probs come from the model's logits (not the fused head)."""
    from rlcore.trainer.recompute import Recompute

    return Recompute(model, role_cfg.gradient_checkpointing, config, device, role=role, logits=logits,
                     selective=_selective(role_cfg))


def _build_data(pm: Any, data_cfg: Any, tcfg: Any, ppo: Any, tokenizer: Any, device: torch.device,
                model_path: str, dist: DistInfo, built: Optional[Built] = None) -> Prompts:
    """The training loader, its batch filler and the held-out rows; sizes ``ppo.rollout_batch_size=auto`` first."""
    from rlcore.data.collate import ensure_input_ids

    built = built if built is not None else Built()
    train_ds = built.add("dataset/train", pm.build_named("rlcore_dataset_provider", config=data_cfg,
                                                         tokenizer=tokenizer, split="train", dist=dist))
    val_rows: list = []
    if data_cfg.val_files or not data_cfg.train_files:
        val_ds = built.add("dataset/val", pm.build_named("rlcore_dataset_provider", config=data_cfg,
                                                         tokenizer=tokenizer, split="val", dist=dist))
        val_rows = _load_rows(val_ds, tcfg.eval_samples)
    val_rows = ensure_input_ids(val_rows, tokenizer, data_cfg, drop_overlong=True) if val_rows else []
    if ppo.rollout_batch_size == "auto":
        from rlcore.rollout.autosize import auto_rollout_batch_size

        ppo.rollout_batch_size = auto_rollout_batch_size(device=device, n=ppo.generation.n, model_path=model_path,
                                                         max_len=data_cfg.max_prompt_length + ppo.generation.max_new_tokens)
    loader = PromptLoader(train_ds, data_cfg, int(ppo.rollout_batch_size), tcfg.seed, dist)
    loader.check_first_batch()  # an iterable set too small for one batch fails before the models load
    return Prompts(loader, BatchFiller(loader, tokenizer, data_cfg, int(ppo.rollout_batch_size)), val_rows)


def _wants_compile(setting: Optional[bool], device: torch.device | str) -> bool:
    """``<role>.compile``: as set, or (``null``) on for a role that trains on CUDA."""
    return bool(setting) if setting is not None else torch.device(device).type == "cuda"


def _load_models(cfg: DictConfig, model_path: str, device: torch.device, placement: Any, actor_fsdp: Any,
                 dist: DistInfo) -> tuple[torch.nn.Module, Optional[torch.nn.Module], Optional[torch.nn.Module]]:
    """``(actor, frozen reference or None, critic or None)``, full (not yet sharded) models, with
    gradient checkpointing and compiled layers as configured."""
    from rlcore.distributed.fsdp import load_model_for_role

    actor_cfg, critic_cfg, ppo, algo = obj(cfg.actor), obj(cfg.critic), obj(cfg.ppo), obj(cfg.algorithm)
    lora = actor_cfg.lora if actor_cfg.lora.rank > 0 else None

    def load_actor() -> torch.nn.Module:
        model = models.load_causal_lm(model_path, actor_cfg.dtype, device, actor_cfg.attn_implementation)
        if lora is None:
            return model
        from rlcore.trainer.lora import add_adapters

        return add_adapters(model, lora)  # inside the loader: other ranks receive rank 0's adapter init

    actor = load_model_for_role(load_actor, actor_fsdp, dist)
    if _enable_checkpointing(actor, actor_cfg) and lora is not None \
            and hasattr(actor, "enable_input_require_grads"):
        actor.enable_input_require_grads()  # frozen embeddings: checkpointed layers still need a graph
    wants_ref = algo.use_reference and ppo.kl_coeff > 0
    # a LoRA actor's reference is the actor itself with the adapters off (set up once it is sharded)
    ref = (actor if lora is not None else models.frozen_copy(actor)) if wants_ref else None
    critic = None
    if trains_critic(algo.adv_estimator):
        critic_path = critic_cfg.model_path or model_path
        base = load_model_for_role(
            lambda: models.load_causal_lm(critic_path, critic_cfg.dtype, placement.device_for("critic"),
                                          critic_cfg.attn_implementation),
            resolve_fsdp(obj(cfg.fsdp), critic_cfg.fsdp), dist)
        critic = models.ValueModel.from_causal_lm(base)
        _enable_checkpointing(critic.backbone, critic_cfg)
    _compile(actor, actor_cfg, "actor", device)  # after the reference copy: the reference runs uncompiled
    if critic is not None:
        _compile(critic, critic_cfg, "critic", placement.device_for("critic"))
    return actor, ref, critic


def _compile(model: torch.nn.Module, role_cfg: Any, role: str, device: torch.device) -> None:
    """``<role>.compile`` (and ``<role>.compile_recompute_pointwise``): the role's decoder layers compiled
    where it asks for it, or by default on CUDA."""
    from rlcore.distributed.fsdp import compile_layers

    if _wants_compile(role_cfg.compile, device):
        compile_layers(model, role, fallback=role_cfg.compile is None,
                       recompute_pointwise=bool(role_cfg.compile_recompute_pointwise))


def _selective(role_cfg: Any) -> bool:
    """``<role>.gradient_checkpointing_policy``: selective where it says so, or where it is null and
    checkpointing is chosen by memory (``auto``); full otherwise."""
    policy = getattr(role_cfg, "gradient_checkpointing_policy", None)
    if policy is None:
        return str(getattr(role_cfg, "gradient_checkpointing", "")) == "auto"
    return str(policy) == "selective"


def _enable_checkpointing(model: torch.nn.Module, role_cfg: Any) -> bool:
    """``<role>.gradient_checkpointing``: true enables it; auto enables the switch that
    :class:`~rlcore.trainer.recompute.Recompute` turns per micro-batch, where the model has one;
    ``<role>.gradient_checkpointing_policy`` says what a checkpointed layer recomputes. Whether
    checkpointing may run."""
    from rlcore.distributed.fsdp import enable_gradient_checkpointing
    from rlcore.trainer.recompute import switchable_layers

    setting = role_cfg.gradient_checkpointing
    if setting is True or (setting == "auto" and switchable_layers(model)):
        enable_gradient_checkpointing(model, selective=_selective(role_cfg))
        return True
    return False


def _generation(pm: Any, actor: torch.nn.Module, actor_module: torch.nn.Module, reshard: ReshardPolicy,
                actor_cfg: Any, data_cfg: Any, ppo: Any, dist: DistInfo,
                trained: Sequence[tuple[torch.nn.Module, Any]] = (), reshard_plugin: str = "reshard policy"
                ) -> ActorGeneration:
    """The actor's rollout: backends of its generation layouts from ``rlcore_rollout_backend``, built on first use.
    ``trained``: the (model, optimizer) pairs updated on the rollout's device, the actor's first, whose
    gradients and optimizer moments not yet allocated when a backend is built are its
    ``memory_reserve_bytes``; the backends are refreshed after each step of the actor's optimizer.
    Every backend call is checked (:class:`rlcore.contract.RolloutContract`); with ``data.env_key`` a
    backend that does not declare ``supports_episodes`` is refused when it is built."""
    from rlcore.contract import RolloutContract, refuse_episodes
    from rlcore.plugin_manager import close_answer

    request = rollout_request(actor_cfg, data_cfg, ppo)
    contract = RolloutContract(vocab_size=getattr(getattr(actor_module, "config", None), "vocab_size", None))

    def build(module: torch.nn.Module, tensor_parallel: bool) -> RolloutBackend:
        reserve = sum(update_reserve_bytes(model, optimizer) for model, optimizer in trained)
        name, backend = pm.build_named("rlcore_rollout_backend", model=module, dist=dist,
                                       request=dataclasses.replace(request, tensor_parallel=tensor_parallel,
                                                                   memory_reserve_bytes=reserve))
        if request.episodes and not getattr(backend, "supports_episodes", False):
            close_answer(backend)
            raise refuse_episodes(name, backend)
        contract.names[id(backend)] = name
        return backend

    prebuilt = {}
    if not dist.distributed:  # single process: the backend reads the training module directly
        prebuilt[id(actor)] = build(actor_module, False)
    generation = ActorGeneration(actor, reshard, build, int(ppo.generation.batch_size), prebuilt=prebuilt,
                                 contract=contract, reshard_plugin=reshard_plugin)
    if trained:  # the actor's optimizer: each of its steps changes the weights the backends read
        generation.follow(trained[0][1])
    return generation


def update_reserve_bytes(model: torch.nn.Module, optimizer: Any = None, moments: int = 2) -> int:
    """Bytes this process's update will still allocate for ``model``: the gradient of each trainable
    weight that has none yet, and ``moments`` optimizer states of its size (AdamW's two) for each weight
    ``optimizer`` holds no state of yet (it creates them at its first step; a resumed optimizer has them).
    Counted on the local shard of a sharded (DTensor) weight."""
    state = getattr(optimizer, "state", {}) if optimizer is not None else {}
    total = 0
    for param in model.parameters():
        if not param.requires_grad:
            continue
        local = param.to_local() if hasattr(param, "to_local") else param
        size = local.numel() * local.element_size()
        total += size * ((param.grad is None) + (0 if state.get(param) else moments))
    return total
