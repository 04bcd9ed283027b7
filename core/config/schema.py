"""The typed configuration tree.

Every section is a dataclass; omegaconf turns them into a structured config in struct mode, so an
unknown key is an error. Each component is handed its own section (``cfg.data``, ``cfg.ppo`` …),
never the whole tree. Keys of the seed template (``fast_train_config.yaml``) keep the meaning the
seed gives them; ``docs/config.md`` documents every key and a test keeps it in step with this file.

Field comments (``#:``) are the reference text: ``python -m rlcore.config.docgen`` turns them into docs/config.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class CustomClsConfig:
    #: A ``.py`` file or ``pkg://module.path`` that defines a dataset class.
    path: Optional[str] = None
    #: Name of the class in ``path``; built as ``cls(data_files, prompt_key=..., **kwargs)``.
    name: Optional[str] = None
    #: Extra keyword arguments for the class.
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class DataConfig:
    #: Training prompts: a parquet/jsonl file, a list of files, or a glob. Empty = built-in demo task.
    train_files: list[str] = field(default_factory=list)
    #: Held-out prompts for evaluation every ``trainer.eval_steps``.
    val_files: list[str] = field(default_factory=list)
    #: Column holding the prompt: plain text, or chat messages rendered with the chat template.
    prompt_key: str = "prompt"
    #: Local directory (fast disk) caching the tokenized, filtered table as Arrow. None = no cache.
    cache_dir: Optional[str] = None
    #: DataLoader worker processes (the seed suggests ~70% of CPU cores).
    num_workers: int = 0
    #: Batches each worker prepares ahead (the seed suggests 4-6). Only used with num_workers > 0.
    prefetch_factor: int = 4
    #: Pin host memory for faster copies to the GPU.
    pin_memory: bool = True
    #: Drop prompts longer than ``max_prompt_length`` tokens (counted and logged).
    filter_overlong_prompts: bool = True
    #: Longest prompt in tokens.
    max_prompt_length: int = 1024
    #: What to do with an overlong prompt that is not filtered: error | left | right.
    truncation: str = "error"
    #: Shuffle training prompts (seeded by ``trainer.seed``).
    shuffle: bool = True
    #: Processes used to tokenize and filter.
    preprocess_workers: int = 1
    #: A user dataset class loaded from a file or package.
    custom_cls: CustomClsConfig = field(default_factory=CustomClsConfig)
    #: Rows the ``streaming`` plugin keeps for shuffling.
    shuffle_buffer: int = 1024
    #: Column naming each row's environment (multi-turn episodes, see ``env``); None = single-turn rollouts. A row whose value is empty is a single turn.
    env_key: Optional[str] = None


@dataclass
class RemeshingConfig:
    #: Use different shard layouts for generation and training (needs the ``remesh`` plugin).
    enabled: bool = False
    #: Ranks holding one tensor-parallel generation replica of the actor.
    generation_shard_size: int = 1
    #: Ranks sharding one training copy of the actor (FSDP groups, replicated across groups).
    training_shard_size: int = 1


@dataclass
class FSDPConfig:
    #: Accepted for compatibility; FSDP2 always keeps the original parameters.
    use_orig_params: bool = True
    #: FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD.
    sharding_strategy: str = "FULL_SHARD"
    #: Keep parameters, gradients and optimizer state on the CPU (FSDP2 CPUOffloadPolicy).
    cpu_offload: bool = False
    #: true: rank 0 loads weights and broadcasts; false: every rank loads the same checkpoint path.
    sync_module_states: bool = True
    #: Compute dtype for FSDP mixed precision: bf16 | fp16 | fp32.
    param_dtype: str = "bf16"
    #: Gradient reduction dtype: fp32 | bf16.
    reduce_dtype: str = "fp32"


@dataclass
class RoleFSDPConfig:
    """Per-role FSDP settings; a key left unset (null) takes the top-level ``fsdp`` value."""

    #: See ``fsdp.use_orig_params``.
    use_orig_params: Optional[bool] = None
    #: See ``fsdp.sharding_strategy``.
    sharding_strategy: Optional[str] = None
    #: See ``fsdp.cpu_offload``.
    cpu_offload: Optional[bool] = None
    #: See ``fsdp.sync_module_states``.
    sync_module_states: Optional[bool] = None
    #: See ``fsdp.param_dtype``.
    param_dtype: Optional[str] = None
    #: See ``fsdp.reduce_dtype``.
    reduce_dtype: Optional[str] = None


def resolve_fsdp(global_cfg: FSDPConfig, role_cfg: RoleFSDPConfig) -> FSDPConfig:
    """The effective FSDP settings of one role: its own keys where set, else the global ones."""
    values = {k: getattr(global_cfg, k) for k in FSDPConfig.__dataclass_fields__}
    for k in FSDPConfig.__dataclass_fields__:
        v = getattr(role_cfg, k)
        if v is not None:
            values[k] = v
    return FSDPConfig(**values)


@dataclass
class ModelRoleConfig:
    #: A Hugging Face model directory. Empty = the demo's tiny model.
    model_path: Optional[str] = None
    #: Where the role lives: auto | cpu | cuda | cuda:N (the placement policy validates it).
    device: str = "auto"
    #: Learning rate of this role's optimizer.
    lr: float = 1e-5
    #: AdamW weight decay.
    weight_decay: float = 0.0
    #: Warmup steps of the learning-rate schedule.
    warmup_steps: int = 0
    #: Learning-rate schedule after warmup: constant | cosine | linear.
    lr_scheduler: str = "constant"
    #: Gradient clipping by global norm (0 = off).
    grad_clip: float = 1.0
    #: Recompute activations in the backward pass to save memory.
    gradient_checkpointing: bool = False
    #: Compile each decoder layer with torch.compile for training (fuses the pointwise work between matrix products; the first steps include compiling). null: on when the role trains on CUDA, off elsewhere.
    compile: Optional[bool] = None
    #: Training dtype of the weights: fp32 | bf16.
    dtype: str = "fp32"
    #: Per-role FSDP settings (unset keys inherit the top-level ``fsdp``).
    fsdp: RoleFSDPConfig = field(default_factory=RoleFSDPConfig)


@dataclass
class ActorConfig(ModelRoleConfig):
    #: Generation vs training layouts of the actor.
    remeshing: RemeshingConfig = field(default_factory=RemeshingConfig)
    #: Rollout backend: auto (fast engine where supported, else HF generate) | engine | hf.
    rollout_backend: str = "auto"
    #: Settings of the rollout engine (ignored by the HF backend), e.g. ``{attention_tuning: {num_warps: 4}, prompt_sharing: false}``: keyword arguments of ``RolloutEngine`` (docs/rollout.md) except the model, batch size, sequence length, device and dtype, which the trainer sets. Checked when the config loads.
    rollout_engine: dict[str, Any] = field(default_factory=dict)


@dataclass
class CriticConfig(ModelRoleConfig):
    #: A Hugging Face model directory for the value model (read only with ``algorithm.adv_estimator=gae``). Empty = initialise from the actor's model.
    model_path: Optional[str] = None
    #: Learning rate of the critic's optimizer (only used with ``algorithm.adv_estimator=gae``).
    lr: float = 1e-5


@dataclass
class RewardModelConfig:
    #: Score with a reward model (a sequence-classification directory with num_labels=1).
    enable: bool = False
    #: Reward-model directory.
    path: Optional[str] = None
    #: cpu | cuda | cuda:N | auto.
    device: str = "auto"
    #: fp32 | bf16 | fp16.
    dtype: str = "bf16"
    #: Keep the RM in pinned CPU memory and move it to the GPU only while scoring (``rm-offload``).
    offload: bool = False
    #: Sequences per reward-model forward pass.
    micro_batch_size: int = 16
    #: Longest input given to the reward model, in its own tokens.
    max_length: int = 2048


@dataclass
class RewardFunctionConfig:
    #: A ``.py`` file or module path holding the reward function. Empty = the task's built-in rule.
    path: Optional[str] = None
    #: Function name in ``path``.
    name: str = "compute_score"
    #: Extra keyword arguments passed to the function.
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardConfig:
    #: Weighted built-in or custom rewards combined into one score, e.g. {exact_match: 1.0, length_penalty: 0.1}.
    weights: dict[str, float] = field(default_factory=dict)
    #: Run reward functions in this many worker processes (0 = in process).
    num_workers: int = 0
    #: Seconds allowed per sample when running in workers.
    timeout_s: float = 30.0
    #: Score given when a reward function raises; None = fail the step and show the sample.
    fallback_score: Optional[float] = None


@dataclass
class GenerationConfig:
    #: Sequences generated per forward batch (micro-batch of the rollout).
    batch_size: int = 64
    #: Longest response in tokens.
    max_new_tokens: int = 128
    #: Sampling temperature (0 = greedy).
    temperature: float = 1.0
    #: Nucleus sampling threshold (1.0 = off).
    top_p: float = 1.0
    #: Top-k filter (0 = off).
    top_k: int = 0
    #: Samples per prompt (GRPO/RLOO need >= 2).
    n: int = 1


@dataclass
class PPOConfig:
    #: Prompts per step on each rank, or "auto" to size from free GPU memory (seed's rule: GPU GB x 0.6 / per-sample GB).
    rollout_batch_size: Any = 8
    #: Rollout settings.
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    #: Samples per optimizer mini-batch (0 = the whole rollout).
    mini_batch_size: int = 0
    #: Samples per forward/backward micro-batch (0 = mini_batch_size / gradient_accumulation_steps).
    micro_batch_size: int = 0
    #: Passes over each rollout.
    ppo_epochs: int = 1
    #: KL strength against the reference policy.
    kl_coeff: float = 0.1
    #: KL estimator: k1 | k2 | mse | k3 | low_var_kl | abs.
    kl_estimator: str = "k1"
    #: true: KL penalty inside the reward; false: KL as a loss term.
    kl_in_reward: bool = True
    #: fixed | adaptive KL controller.
    kl_ctrl: str = "fixed"
    #: Target KL of the adaptive controller.
    kl_target: float = 6.0
    #: Horizon (samples) of the adaptive controller.
    kl_horizon: int = 10000
    #: Policy ratio clip range.
    cliprange: float = 0.2
    #: Upper clip range ("clip-higher"); None = cliprange.
    cliprange_high: Optional[float] = None
    #: Dual-clip constant (> 1) for negative advantages; None = off.
    dual_clip: Optional[float] = None
    #: Value clip range around the old values.
    cliprange_value: float = 0.2
    #: Weight of the value loss.
    vf_coef: float = 0.5
    #: Entropy bonus weight.
    entropy_coeff: float = 0.0
    #: Loss aggregation: token-mean | seq-mean-token-sum | seq-mean-token-mean.
    loss_agg: str = "token-mean"
    #: Cut each training forward to the columns its samples use (leading prompt padding, trailing response padding); exact, only faster.
    trim_padding: bool = True
    #: Sort each mini-batch by length before cutting it into micro-batches, so that similar lengths share a forward (with trim_padding: less padding); the gradient is unchanged.
    group_by_length: bool = True


def trains_critic(adv_estimator: str) -> bool:
    """Whether ``algorithm.adv_estimator`` trains a critic (GAE does; GRPO and RLOO have none)."""
    return adv_estimator == "gae"


@dataclass
class AlgorithmConfig:
    #: gae (PPO with a critic) | grpo | rloo.
    adv_estimator: str = "gae"
    #: Discount.
    gamma: float = 1.0
    #: GAE lambda.
    lam: float = 0.95
    #: GRPO: divide by the group's standard deviation.
    norm_adv_by_std: bool = True
    #: Whiten GAE advantages over the batch.
    whiten_advantages: bool = True
    #: Use a frozen reference policy (needed for a KL term; off when kl_coeff == 0).
    use_reference: bool = True


@dataclass
class TrainerConfig:
    #: RL steps to run (each: rollout, reward, then ``ppo.ppo_epochs`` passes of optimizer steps).
    max_steps: int = 100
    #: Save a checkpoint every N steps (0 = only at the end).
    save_steps: int = 0
    #: Checkpoints kept.
    save_total_limit: int = 2
    #: Log metrics every N steps.
    log_steps: int = 1
    #: Evaluate on ``data.val_files`` every N steps (0 = only at start and end).
    eval_steps: int = 0
    #: Micro-batches accumulated per optimizer step (each mini-batch is split into this many; ignored when ppo.micro_batch_size is set).
    gradient_accumulation_steps: int = 1
    #: Write torch.profiler traces.
    enable_profiling: bool = False
    #: Steps profiled (after one warm-up step).
    profile_steps: int = 5
    #: Run directory: checkpoints, metrics, traces, plots.
    output_dir: str = "runs/rlcore"
    #: auto | disable | a checkpoint path. disable moves an earlier run in output_dir to output_dir/previous-runs/.
    resume: str = "auto"
    #: Seed for python, numpy and torch.
    seed: int = 0
    #: Device of single-process runs: auto | cpu | cuda.
    device: str = "auto"
    #: Processes to start on this node with torch's elastic launcher (1 = this process only).
    nproc_per_node: int = 1
    #: Show a progress bar.
    progress: bool = True
    #: Save checkpoints asynchronously.
    async_save: bool = False
    #: Export the final policy as a Hugging Face directory.
    export_final: bool = True
    #: Sample the GPU with NVML during training.
    gpu_monitor: bool = True
    #: Seconds between GPU samples.
    gpu_monitor_interval: float = 0.5
    #: Evaluation reads the first N held-out prompts (from data.val_files, or the demo's held-out set).
    eval_samples: int = 64


@dataclass
class PlacementConfig:
    """Where the roles live over the ranks of a distributed run (see docs/distributed.md, Placement)."""

    #: Role -> the global ranks that hold it, e.g. {reward: [0]}; a role not named is on every rank,
    #: and empty = every role on every rank. Only ``reward`` may be split in this version (actor,
    #: critic and ref train with FSDP over all ranks): the reward model loads on its ranks only and
    #: the other ranks' samples are scored there.
    rank_groups: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class EnvConfig:
    #: Most model turns per episode (``plugin_config.<environment>.max_turns`` overrides it per environment).
    max_turns: int = 4
    #: Most tokens after the prompt, model and observation tokens together; None = ``ppo.generation.max_new_tokens`` (also the upper bound). ``plugin_config.<environment>.max_tokens`` overrides it.
    max_tokens: Optional[int] = None
    #: Texts that end a model turn besides EOS (the turn keeps them).
    stop: list[str] = field(default_factory=lambda: ["</tool_call>"])
    #: Tool-call parser of tool environments, by registered name.
    tool_parser: str = "hermes"
    #: Environment calls running at once (coroutines, and worker threads for plain functions).
    max_concurrency: int = 64
    #: Seconds an environment may take to answer a turn; past it the episode ends (counted in ``env/timeouts``).
    timeout_s: float = 60.0


@dataclass
class RLCoreConfig:
    #: Plugins to load by name from the ``rlcore.plugins`` entry-point group.
    plugins: list[str] = field(default_factory=list)
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: RewardFunctionConfig = field(default_factory=RewardFunctionConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    #: Global FSDP defaults (the seed's top-level ``fsdp``); ``actor.fsdp`` / ``critic.fsdp`` refine them.
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    #: Which ranks hold each role (default: every role on every rank).
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    #: Multi-turn episodes: how turns end and the limits of an episode (used when ``data.env_key`` is set).
    env: EnvConfig = field(default_factory=EnvConfig)
    #: Free-form sections of plugins, keyed by plugin name (``plugin_config.<name>.<key>``).
    plugin_config: dict[str, Any] = field(default_factory=dict)
