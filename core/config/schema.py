"""The typed configuration tree.

Every section is a dataclass; omegaconf turns them into a structured config in struct mode, so an
unknown key is an error. Each component is handed its own section (``cfg.data``, ``cfg.ppo`` …),
never the whole tree. Keys of the seed template (``fast_train_config.yaml``) keep the meaning the
seed gives them; ``docs/config.md`` documents every key and a test keeps it in step with this file.

Field comments (``#:``) are the reference text: ``python tools/docgen.py`` turns them into docs/config.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional


# --------------------------------------------------------------------------------------------
# Allowed values: one str enum per kind of choice. The config checks, the math and the reference
# page all read them, so adding a member (one line) makes a value valid everywhere at once.
# --------------------------------------------------------------------------------------------


class Choice(str, Enum):
    """A set of allowed string values. Members compare equal to their value (``KLEstimator.k1 ==
    "k1"``) and print as it, so code may keep comparing with plain strings."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __hash__(self) -> int:  # as its value's, so a member finds a dict entry keyed by the plain string
        return str.__hash__(self)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


def choice(name: str, *values: str) -> type[Choice]:
    """A :class:`Choice` enum whose members are named by their values (``choice("Kind", "a", "b-c")``):
    omegaconf, the YAML a run saves and the user all spell a value the same way."""
    return Choice(name, [(value, value) for value in values], module=__name__, qualname=name)


AdvEstimator = choice("AdvEstimator", "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                      "remax")
KLEstimator = choice("KLEstimator", "k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs", "k1+", "k3+")
KLControllerKind = choice("KLControllerKind", "fixed", "adaptive")
LossAgg = choice("LossAgg", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                 "token-sum")
PolicyLoss = choice("PolicyLoss", "vanilla", "gspo", "cispo")
Truncation = choice("Truncation", "error", "left", "right")
ShardingStrategy = choice("ShardingStrategy", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
#: dtype names; :func:`torch_dtype` maps them to torch's
Dtype = choice("Dtype", "fp32", "bf16", "fp16")
#: dtypes a role trains in and gradients are reduced in (no fp16: it needs loss scaling)
TrainDtype = choice("TrainDtype", "fp32", "bf16")
AttentionKind = choice("AttentionKind", "auto", "sdpa", "triton")
CompileMode = choice("CompileMode", "default", "max-autotune-no-cudagraphs")
KVCacheKind = choice("KVCacheKind", "paged", "static")
RolloutIS = choice("RolloutIS", "none", "token", "sequence")
#: how the training forwards turn last hidden states into log-probs (:func:`rlcore.trainer.models.set_logprob_head`)
LogprobHead = choice("LogprobHead", "auto", "fused", "logits")
#: what a checkpointed decoder layer recomputes in the backward (:mod:`rlcore.trainer.recompute`)
CheckpointPolicyKind = choice("CheckpointPolicyKind", "full", "selective")
#: what the ``python`` environment asks of its sandbox (docs/environments.md, The Python sandbox)
SandboxMode = choice("SandboxMode", "strict", "best-effort")
#: Hugging Face ``attn_implementation`` values of the training forwards; the variable-length ones
#: (:data:`rlcore.trainer.packing.VARLEN_ATTENTION`) let ``ppo.pack_sequences=auto`` pack
AttnImplementation = choice("AttnImplementation", "sdpa", "eager", "flex_attention", "flash_attention_2",
                            "flash_attention_3")


def torch_dtype(name: str):
    """``"bf16"`` -> ``torch.bfloat16``: the one map from the config's dtype names to torch's."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[str(Dtype(name))]


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
    #: Training prompts: a parquet/jsonl file, a list of files, or a glob. Empty, with no ``data.custom_cls`` and no
    #: selected plugin implementing ``rlcore_dataset_provider``, = the built-in demo task.
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
    #: What to do with an overlong prompt that is not filtered: fail (error) or cut it on the left or right.
    truncation: Truncation = Truncation.error
    #: Shuffle training prompts (seeded by ``trainer.seed``).
    shuffle: bool = True
    #: Processes used to tokenize and filter.
    preprocess_workers: int = 1
    #: A user dataset class loaded from a file or package.
    custom_cls: CustomClsConfig = field(default_factory=CustomClsConfig)
    #: Rows the ``streaming`` plugin keeps for shuffling.
    shuffle_buffer: int = 1024
    #: Column naming each row's environment (multi-turn episodes, see ``env``); None = single-turn rollouts. A row
    #: whose value is empty is a single turn.
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
    #: How FSDP shards parameters, gradients and optimizer state (docs/distributed.md).
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    #: Keep parameters, gradients and optimizer state on the CPU (FSDP2 CPUOffloadPolicy).
    cpu_offload: bool = False
    #: true: rank 0 loads weights and broadcasts; false: every rank loads the same checkpoint path.
    sync_module_states: bool = True
    #: Compute dtype for FSDP mixed precision.
    param_dtype: Dtype = Dtype.bf16
    #: Gradient reduction dtype.
    reduce_dtype: TrainDtype = TrainDtype.fp32


@dataclass
class RoleFSDPConfig:
    """Per-role FSDP settings; a key left unset (null) takes the top-level ``fsdp`` value."""

    #: See ``fsdp.use_orig_params``.
    use_orig_params: Optional[bool] = None
    #: See ``fsdp.sharding_strategy``.
    sharding_strategy: Optional[ShardingStrategy] = None
    #: See ``fsdp.cpu_offload``.
    cpu_offload: Optional[bool] = None
    #: See ``fsdp.sync_module_states``.
    sync_module_states: Optional[bool] = None
    #: See ``fsdp.param_dtype``.
    param_dtype: Optional[Dtype] = None
    #: See ``fsdp.reduce_dtype``.
    reduce_dtype: Optional[TrainDtype] = None


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
    #: A Hugging Face model directory. Empty: `rlcore train` uses the demo's tiny model (the demo preset); a Trainer
    #: built in Python needs it set.
    model_path: Optional[str] = None
    #: Where the role lives: auto | cpu | cuda | cuda:N (the placement policy validates it).
    device: str = "auto"
    #: Learning rate of this role's optimizer.
    lr: float = 1e-5
    #: AdamW weight decay.
    weight_decay: float = 0.0
    #: AdamW coefficients of the running averages of the gradient and its square (beta1, beta2).
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    #: AdamW term added to the denominator for numerical stability.
    eps: float = 1e-8
    #: Warmup steps of the learning-rate schedule.
    warmup_steps: int = 0
    #: Learning-rate schedule: any name ``transformers.get_scheduler`` knows (``transformers.SchedulerType``), e.g.
    #: constant, linear, cosine, cosine_with_min_lr, polynomial, warmup_stable_decay; warmup for ``warmup_steps``
    #: first. ``constant`` with warmup steps is ``constant_with_warmup``.
    lr_scheduler: str = "constant"
    #: Extra keyword arguments of the schedule (``scheduler_specific_kwargs`` of ``get_scheduler``), e.g.
    #: ``{num_cycles: 2}`` for cosine_with_restarts or ``{min_lr_rate: 0.1}`` for cosine_with_min_lr.
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    #: Gradient clipping by global norm (0 = off).
    grad_clip: float = 1.0
    #: Recompute activations in the backward pass to save memory: true | false | auto (per micro-batch, on when
    #: its activation memory, estimated from the shape until measured on CUDA, exceeds the free memory; once
    #: measured, only in as many decoder layers as it takes to fit; with the fused head a token budget is first
    #: lowered to what fits; see docs/architecture.md, Training on variable lengths).
    gradient_checkpointing: Any = "auto"
    #: What a checkpointed layer recomputes: full (its whole forward: the least memory, a third more compute) |
    #: selective (the outputs of its matrix products and attention are kept, only the pointwise work between them is
    #: recomputed: about half the activation memory of no checkpointing for a few percent more compute; with
    #: gradient_checkpointing=auto the token budget is lowered to what fits that way). null: selective with
    #: gradient_checkpointing=auto (measured faster, docs/benchmarks.md), full with true.
    gradient_checkpointing_policy: Optional[CheckpointPolicyKind] = None
    #: Compile each decoder layer with torch.compile for training (fuses the pointwise work between matrix products;
    #: the first steps include compiling). null: on when the role trains on CUDA, off elsewhere.
    compile: Optional[bool] = None
    #: With compiled layers, their backward recomputes the pointwise results that feed matrix products (the norms'
    #: outputs, SiLU·mul) instead of keeping them from the forward: a third less activation memory a layer (Qwen2-1.5B
    #: shape), so fewer layers need checkpointing, for a pointwise pass more in the backward; the same gradients (bit
    #: for bit on CPU, up to bf16 rounding on CUDA). Measured 6% faster in the reasoning update (docs/benchmarks.md).
    compile_recompute_pointwise: bool = True
    #: Training dtype of the weights.
    dtype: TrainDtype = TrainDtype.fp32
    #: Attention of this role's training forwards (the model's ``attn_implementation``). null: the model's own
    #: choice (sdpa). flash_attention_2 / flash_attention_3 (the flash-attn package, CUDA) and flex_attention (CUDA:
    #: no backward on CPU) run packed sequences as variable-length attention, so ppo.pack_sequences=auto packs.
    attn_implementation: Optional[AttnImplementation] = None
    #: Per-role FSDP settings (unset keys inherit the top-level ``fsdp``).
    fsdp: RoleFSDPConfig = field(default_factory=RoleFSDPConfig)


@dataclass
class AttentionTuningConfig:
    """Settings of the Triton decode-attention kernel; a key left null takes the kernel's own choice."""

    #: Key/value columns per block: a power of two >= 16 (null: 64, or 32 for head dims of 128 and more).
    block_n: Optional[int] = None
    #: Warps per program: a power of two <= 32 (null: 2 for head dims up to 64, else 4).
    num_warps: Optional[int] = None
    #: Software-pipelining stages of the key/value loads (null: Triton's default).
    num_stages: Optional[int] = None
    #: Chunks each (slot, key/value head) cuts the attended length into (null: more only when there are few slots).
    splits: Optional[int] = None
    #: The most columns one program attends: longer rows are cut into more chunks even in a full batch, so one long
    #: row among short ones is not every layer's critical path (null: the kernel's default, 1024; 0: no cap).
    max_chunk: Optional[int] = None
    #: Softmax states per block, a power of two leaving >= 16 columns each (null: 1).
    subblocks: Optional[int] = None
    #: With RoPE in the kernel, gather each slot's RoPE rows once a step instead of in every layer (null: true).
    rope_rows: Optional[bool] = None


@dataclass
class SplitKConfig:
    """Slices of the inner dimension the decode step's products are cut into. All null: the engine's
    choice (on CUDA with compilation o 2, down 4, q/k/v 2; else none); once one is set, unset ones are 1."""

    #: Slices of the attention output projection.
    o: Optional[int] = None
    #: Slices of the MLP's gate/up projection.
    gate_up: Optional[int] = None
    #: Slices of the MLP's down projection.
    down: Optional[int] = None
    #: Slices of the q/k/v projection.
    qkv: Optional[int] = None


@dataclass
class RolloutEngineConfig:
    """Settings of the in-process rollout engine (``RolloutEngine``, docs/rollout.md), checked when the config loads."""

    #: Capture each decode step in a CUDA graph and replay it (CUDA only).
    use_cuda_graphs: bool = True
    #: Batch sizes whose decode graphs are captured (the generation batch size is always added).
    graph_batch_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    #: Refill free slots once at least this fraction of them is free (or nothing runs), so prompts prefill in groups.
    admit_fraction: float = 0.125
    #: Decode steps between host reads of the finished flags.
    eos_check_interval: int = 8
    #: Multi-turn calls read the turn-end flags and the rows' tokens from a copy taken every eos_check_interval
    #: steps without waiting for the device, once the device has passed it (turns end a few steps later, the
    #: episodes are the same; the host runs at most eos_check_interval steps ahead of the device); off: each check
    #: waits for the device. On by default: measured 12% faster on the multi-turn benchmark (docs/benchmarks.md,
    #: "Multi-turn rollouts").
    lagged_turn_ends: bool = True
    #: Bound on prompts x width per prefill call (activation memory).
    max_prefill_tokens: int = 65536
    #: On CUDA, sample unfiltered steps (no top-k/top-p) with the one-pass Triton kernel.
    fused_sampling: bool = True
    #: Fuse the decode step's pointwise work with torch.compile (null: on CUDA only).
    compile: Optional[bool] = None
    #: torch.compile mode (the engine captures its own CUDA graphs, so modes adding graphs are not offered).
    compile_mode: CompileMode = CompileMode("default")
    #: Decode attention: auto (triton where it runs and passes its check, else sdpa), sdpa (PyTorch's fused attention)
    #: or triton (the grouped-query decode kernel).
    attention: AttentionKind = AttentionKind.auto
    #: Granularity of the attended cache length in columns (null: 64, coarser for long caches).
    attention_length_step: Optional[int] = None
    #: With triton attention, the kernel also applies RoPE and writes the new key/value to the cache.
    rope_in_attention: bool = True
    #: Split-K of the decode step's products.
    split_k: SplitKConfig = field(default_factory=SplitKConfig)
    #: Split-K of the decode step's products for batch buckets of at most 8 rows (the long tail of a rollout of
    #: varied lengths, where the products read the weights for few rows). All null: as split_k.
    split_k_few_rows: SplitKConfig = field(default_factory=SplitKConfig)
    #: Take the gate/up product as weight @ norm(x)^T (null: on when the step is compiled on CUDA).
    mlp_transposed: Optional[bool] = None
    #: Tuning of the Triton attention kernel.
    attention_tuning: AttentionTuningConfig = field(default_factory=AttentionTuningConfig)
    #: With triton attention, the samples of a prompt read its keys/values from one cache row.
    prompt_sharing: bool = True
    #: KV cache: paged (a pool of pages taken as samples grow, prompts shared by reference) or static (one row of
    #: max_seq_len per slot).
    kv_cache: KVCacheKind = KVCacheKind.paged
    #: Columns per page of the paged cache (a power of two >= 16; with the Triton attention, auto or triton, a multiple
    #: of its column block: 64, or attention_tuning.block_n).
    page_size: int = 64
    #: Pages in the pool, the null page included (null: enough for every slot at the longest sequence, capped on CUDA
    #: at kv_memory_fraction of the free memory).
    kv_pages: Optional[int] = None
    #: Share of the free GPU memory the paged cache's pool takes when kv_pages is null.
    kv_memory_fraction: float = 0.5
    #: Hand the KV cache's memory back to the device after each rollout, so the update can use it, and take it again
    #: at the same addresses (the decode's CUDA graphs stay valid) when the next rollout starts: null = where the
    #: device allows it (default: CUDA with its virtual memory API; the update checkpoints less, docs/benchmarks.md),
    #: true = released (an error where it cannot be), false = the cache stays allocated.
    release_kv: Optional[bool] = None

    def engine_kwargs(self) -> dict[str, Any]:
        """These settings as keyword arguments of ``RolloutEngine``."""
        split = {k: v for k, v in dataclasses.asdict(self.split_k).items() if v is not None}
        few = {k: v for k, v in dataclasses.asdict(self.split_k_few_rows).items() if v is not None}
        tuning = {k: v for k, v in dataclasses.asdict(self.attention_tuning).items() if v is not None}
        return dict(use_cuda_graphs=self.use_cuda_graphs, graph_batch_buckets=list(self.graph_batch_buckets),
                    admit_fraction=self.admit_fraction, eos_check_interval=self.eos_check_interval,
                    lagged_turn_ends=self.lagged_turn_ends,
                    max_prefill_tokens=self.max_prefill_tokens, fused_sampling=self.fused_sampling,
                    compile=self.compile, compile_mode=str(self.compile_mode), attention=str(self.attention),
                    attention_length_step=self.attention_length_step, rope_in_attention=self.rope_in_attention,
                    split_k=split or "auto", split_k_few_rows=few or None, attention_tuning=tuning,
                    mlp_transposed="auto" if self.mlp_transposed is None else self.mlp_transposed,
                    prompt_sharing=self.prompt_sharing, kv_cache=str(self.kv_cache), page_size=self.page_size,
                    kv_pages=self.kv_pages, kv_memory_fraction=self.kv_memory_fraction, release_kv=self.release_kv)


@dataclass
class LoraConfig:
    """LoRA adapters on the actor (needs ``pip install rlcore[lora]``, which brings ``peft``)."""

    #: Adapter rank r; 0 = no adapters (full fine-tuning).
    rank: int = 0
    #: Scaling numerator: the adapter's update is multiplied by alpha / rank.
    alpha: float = 16.0
    #: Dropout on the adapter's input during training.
    dropout: float = 0.0
    #: Names of the linear layers that get adapters (matched against the end of module names); the token
    #: embeddings and the output head (embed_tokens, lm_head, ...) are refused.
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                "gate_proj", "up_proj", "down_proj"])


@dataclass
class ActorConfig(ModelRoleConfig):
    #: Generation vs training layouts of the actor.
    remeshing: RemeshingConfig = field(default_factory=RemeshingConfig)
    #: Rollout backend: auto (the fast engine where it supports the model, else HF generate), engine, hf, or the
    #: name a selected backend plugin answers to (``rlcore_rollout_backend``).
    rollout_backend: str = "auto"
    #: LoRA adapters (``rank > 0``): only the adapters train; the reference policy is the same model with the
    #: adapters disabled (no second copy); the rollout engine generates with the adapters merged into its own weights.
    lora: LoraConfig = field(default_factory=LoraConfig)
    #: Settings of the rollout engine (ignored by the HF backend; docs/rollout.md). The trainer sets the model, batch
    #: size, sequence length, device and dtype.
    rollout_engine: RolloutEngineConfig = field(default_factory=RolloutEngineConfig)


@dataclass
class CriticConfig(ModelRoleConfig):
    #: A Hugging Face model directory for the value model (read only with ``algorithm.adv_estimator=gae``). Empty =
    #: initialise from the actor's model.
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
    #: Dtype of the reward model's weights.
    dtype: Dtype = Dtype.bf16
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
    #: Seconds allowed per sample (in worker processes, or in a worker thread with num_workers=0).
    timeout_s: float = 30.0
    #: Score given when a reward function raises, times out or returns None; None = fail the step and show the sample.
    fallback_score: Optional[float] = None
    #: Score finished samples in a worker thread while the rest of the rollout still decodes (rollout engine, one
    #: process, no reward model; else after the rollout). Scores are the same; a batched reward function then sees
    #: the finished samples in groups: set false if it needs the whole rollout at once.
    stream: bool = True
    #: Largest share of a step's samples that may get reward.fallback_score; above it the run stops with an error
    #: (1 = never stop). A warning is logged whenever more than half of a step's samples get it.
    max_fallback_share: float = 0.9


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
class PartialRolloutConfig:
    """Partial rollouts: each step decodes at most ``segment`` new tokens of a sample, or stops decoding when only
    ``tail_rows`` samples are left; unfinished samples are carried into the next step and a prompt's group trains
    at the step its last sample finishes."""

    #: New tokens a sample decodes per step (0 = off). A sample without an end-of-sequence token and shorter than
    #: ``ppo.generation.max_new_tokens`` is carried into the next step, which decodes on after its tokens under the
    #: current weights; a prompt's group trains at the step its last sample finishes. Needs ``ppo.rollout_is``
    #: (token or sequence) for the older policies' tokens; one process, single-turn rollouts, no dynamic sampling,
    #: no ``ppo.overlap_update``, no remax. At or above max_new_tokens every sample finishes in its first step (as
    #: off). See docs/architecture.md, Partial rollouts.
    segment: int = 0
    #: End each step's generation once at most this many samples are still decoding and no prompt waits for a
    #: slot (0 = off): the long tail of a rollout of varied lengths, where the device decodes a few rows at a time,
    #: is carried into the next step instead, where those samples decode on beside the new ones (re-prefilled
    #: under the current weights). With the rollout engine (another backend decodes every sample to its end);
    #: the same needs as `segment` (ppo.rollout_is, one process, single-turn rollouts, ...), with which it
    #: combines. Give ppo.generation.batch_size room for the carried samples (rollout_batch_size x n + tail_rows;
    #: the trainer warns otherwise). See docs/architecture.md, Partial rollouts.
    tail_rows: int = 0


@dataclass
class PPOConfig:
    #: Prompts per step on each rank, or "auto" to size from free GPU memory (seed's rule: GPU GB x 0.6 / per-sample
    #: GB).
    rollout_batch_size: Any = 8
    #: Rollout settings.
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    #: Samples per optimizer mini-batch (0 = the whole rollout).
    mini_batch_size: int = 0
    #: Samples per forward/backward micro-batch (0 = mini_batch_size / gradient_accumulation_steps).
    micro_batch_size: int = 0
    #: Token budget of a micro-batch (0 = off): each mini-batch is cut into micro-batches of at most this many
    #: tokens (real tokens when packed, rows x padded width otherwise) instead of micro_batch_size samples; the
    #: old/reference log-prob and value passes are cut the same way. A longer sample is a micro-batch of its own.
    max_tokens_per_micro_batch: int = 0
    #: Pack each training forward's sequences into one row without padding (positions restart at each sequence,
    #: attention stays inside it): true | false | auto (pack when the models run a variable-length attention,
    #: flash or flex, and pass a packed-attention check at load; with sdpa/eager a packed row is one dense masked
    #: attention, quadratic in its length).
    pack_sequences: Any = "auto"
    #: How the actor's and the reference's log-prob forwards leave the last hidden states: logits (the model's own
    #: logits) | fused (the vocabulary projection fused with the log-softmax, a chunk of tokens at a time, so the
    #: [tokens, vocabulary] logits and their gradient are never held whole: less memory, for one more head product
    #: in the backward; measured slower than the logits on an H100 at 1.5B, see docs/benchmarks.md) | auto (fused
    #: on CUDA). Models with anything between the head and the softmax (soft-capping, logit scales), LoRA on the
    #: head, FSDP-sharded heads, and an entropy bonus with a gradient use the logits.
    logprob_head: LogprobHead = LogprobHead.logits
    #: Passes over each rollout.
    ppo_epochs: int = 1
    #: KL strength against the reference policy.
    kl_coeff: float = 0.1
    #: KL estimator (docs/algorithms.md): kl is an alias of k1; k1+ and k3+ are straight-through (the value of k1/k3
    #: with the gradient of k2; see docs/recipes.md).
    kl_estimator: KLEstimator = KLEstimator.k1
    #: true: KL penalty inside the reward; false: KL as a loss term.
    kl_in_reward: bool = True
    #: KL controller: a fixed coefficient or one adapted towards ``kl_target``.
    kl_ctrl: KLControllerKind = KLControllerKind.fixed
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
    #: Entropy bonus weight (the entropy term is aggregated by ``ppo.loss_agg`` like the policy loss).
    entropy_coeff: float = 0.0
    #: How per-token losses (the policy loss, the entropy bonus and the KL loss) are reduced to one number
    #: (docs/algorithms.md); seq-mean-token-sum-norm is Dr. GRPO's (token sums over the constant
    #: ``ppo.generation.max_new_tokens``).
    loss_agg: LossAgg = LossAgg("token-mean")
    #: Policy-gradient loss: vanilla (PPO clip), gspo (sequence-level ratio, clipped per sequence) or cispo (clipped,
    #: detached importance weight). See docs/recipes.md.
    policy_loss: PolicyLoss = PolicyLoss.vanilla
    #: Cut each training forward to the columns its samples use (leading prompt padding, trailing response padding);
    #: exact, only faster.
    trim_padding: bool = True
    #: Sort each mini-batch by length before cutting it into micro-batches, so that similar lengths share a forward
    #: (with trim_padding: less padding); the gradient is unchanged.
    group_by_length: bool = True
    #: Truncated importance sampling for the rollout/trainer mismatch: none | token (per-token weight
    #: min(p_trainer / p_rollout, cap)) | sequence (the product over the sequence, capped); multiplies every
    #: token's policy-gradient loss.
    rollout_is: RolloutIS = RolloutIS.none
    #: Cap C of the rollout_is weights (> 0).
    rollout_is_cap: float = 2.0
    #: Run the update's forward and backward of finished groups while the rest of the rollout decodes (on a
    #: CUDA stream of lower priority than the decode); the optimizer step waits for the rollout's end. Only where
    #: the update is one optimizer step computed from the rollout alone: one process, ppo_epochs=1 and one
    #: mini-batch, no reference model or critic, adv_estimator grpo or rloo, reward.stream scoring, no dynamic
    #: sampling, multi-turn episodes or rollout_is; otherwise the reason is logged once and the update runs after
    #: the rollout. The same gradient up to float rounding (docs/architecture.md). Measured slower than off on
    #: the 1.5B reasoning benchmark (docs/benchmarks.md).
    overlap_update: bool = False
    #: Partial rollouts: samples decode at most ``segment`` tokens a step and unfinished ones carry over.
    partial_rollout: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)


def trains_critic(adv_estimator: str) -> bool:
    """Whether ``algorithm.adv_estimator`` trains a critic (GAE does; the others have none)."""
    return adv_estimator == AdvEstimator.gae


#: Estimators whose baseline is the other samples of a prompt's group (they need ``ppo.generation.n >= 2``).
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: groups whose rewards are all equal are dropped, more prompts drawn."""

    #: Drop groups whose samples all got the same reward (no learning signal) and draw more prompts until the
    #: batch holds ``ppo.rollout_batch_size`` groups.
    enable: bool = False
    #: Extra rollout rounds allowed per step (0 = none: train on the groups that are left). When the cap is
    #: reached, the step trains on the groups kept so far (with a warning).
    max_rounds: int = 4


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: a soft penalty over the last ``length`` tokens before the cap."""

    #: Tokens before ``ppo.generation.max_new_tokens`` where the penalty ramps from 0 to ``-penalty_factor`` (0 = off).
    length: int = 0
    #: Penalty at the length cap.
    penalty_factor: float = 1.0


@dataclass
class AlgorithmConfig:
    #: Advantage estimator: gae (PPO with a critic), grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline or
    #: remax (greedy-rollout baseline). See docs/recipes.md.
    adv_estimator: AdvEstimator = AdvEstimator.gae
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
    #: DAPO dynamic sampling (filter groups with equal rewards, refill the batch).
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    #: DAPO overlong reward shaping.
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    #: Leave responses cut at ``ppo.generation.max_new_tokens`` (no end-of-sequence token) out of the loss; they
    #: still count in their group's baseline.
    mask_truncated: bool = False


@dataclass
class TrainerConfig:
    #: RL steps to run (each: rollout, reward, then ``ppo.ppo_epochs`` passes of optimizer steps).
    max_steps: int = 100
    #: Save a checkpoint every N steps (0 = only at the end).
    save_steps: int = 0
    #: Checkpoints kept, the newest (0: every one).
    save_total_limit: int = 2
    #: Optimizer steps in a row whose loss or gradient norm is NaN/inf that are skipped before the run stops with an
    #: error (0 = stop at the first).
    max_nonfinite_steps: int = 5
    #: Log metrics every N steps.
    log_steps: int = 1
    #: Evaluate on ``data.val_files`` every N steps (0 = only at start and end).
    eval_steps: int = 0
    #: Micro-batches accumulated per optimizer step (each mini-batch is split into this many; ignored when
    #: ppo.micro_batch_size is set).
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
    #: Scaled-dot-product attention kernels PyTorch may pick on CUDA (training forwards with
    #: attn_implementation=sdpa, the engine's prefill): a list of flash, efficient, cudnn, math. null: PyTorch's
    #: own choice (rlcore.trainer.sdpa).
    sdpa_backends: Optional[list[str]] = None
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
class EvalConfig:
    """How a policy is scored on held-out prompts: ``rlcore eval``, and the trainer's evaluations."""

    #: Samples per prompt; pass@k is reported for every k from 1 to n (the unbiased estimator).
    n: int = 1
    #: Sampling temperature (0 = greedy).
    temperature: float = 0.0
    #: Nucleus sampling threshold (1.0 = off).
    top_p: float = 1.0
    #: Top-k filter (0 = off).
    top_k: int = 0
    #: Longest response in tokens (null: ``ppo.generation.max_new_tokens``).
    max_new_tokens: Optional[int] = None
    #: A sample passes (counts for pass@k) when its reward is at least this.
    pass_threshold: float = 1.0
    #: Prompts ``rlcore eval`` reads from ``data.val_files`` (0: every row; null: ``trainer.eval_samples``, the rows
    #: the trainer's evaluations read).
    max_prompts: Optional[int] = 0
    #: Where ``rlcore eval`` writes its JSON report (null: ``<trainer.output_dir>/eval.json``).
    output: Optional[str] = None
    #: The model directory an rlcore checkpoint given as ``actor.model_path`` was trained from (its architecture and
    #: tokenizer; null: the run's demo model, for a run of the demo).
    base_model: Optional[str] = None


@dataclass
class PlacementConfig:
    """Where the roles live over the ranks of a distributed run (see docs/distributed.md, Placement)."""

    #: Role -> the global ranks that hold it, e.g. {reward: [0]}; a role not named is on every rank,
    #: and empty = every role on every rank. Only ``reward`` may be split in this version (actor,
    #: critic and ref train with FSDP over all ranks): the reward model loads on its ranks only and
    #: the other ranks' samples are scored there.
    rank_groups: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class PythonEnvConfig:
    """The built-in ``python`` environment's sandbox (its limits are under ``plugin_config.python``)."""

    #: ``strict``: a run whose data uses the ``python`` environment is refused before any model loads
    #: where this host cannot give its code namespaces and a filesystem of its own (``rlcore validate``
    #: says which level the host gives), and a tool call that ran with less is not shown to the model.
    #: ``best-effort``: run with what the host gives; the guards are logged once and each call counts
    #: in ``env/sandbox_strict`` (1 when it had the strict guards) and ``env/sandbox_weak``.
    sandbox: SandboxMode = SandboxMode("strict")


@dataclass
class EnvConfig:
    #: Most model turns per episode (``plugin_config.<environment>.max_turns`` overrides it per environment).
    max_turns: int = 4
    #: Most tokens after the prompt, model and observation tokens together; None =
    #: ``ppo.generation.max_new_tokens`` (also the upper bound). ``plugin_config.<environment>.max_tokens``
    #: overrides it.
    max_tokens: Optional[int] = None
    #: Texts that end a model turn besides EOS (the turn keeps them).
    stop: list[str] = field(default_factory=lambda: ["</tool_call>"])
    #: Tool-call parser of tool environments, by registered name.
    tool_parser: str = "hermes"
    #: Environment calls running at once (coroutines, and worker threads for plain functions).
    max_concurrency: int = 64
    #: Seconds an environment may take to answer a turn (past it the episode ends, counted in ``env/timeouts``), and
    #: to start an episode (past it the run stops with an error naming the environment).
    timeout_s: float = 60.0
    #: Most characters of an observation (all its messages together) that are rendered and tokenized; the rest is
    #: cut off (counted in ``env/observations_cut``).
    max_observation_chars: int = 32768
    #: The built-in ``python`` environment's sandbox.
    python: PythonEnvConfig = field(default_factory=PythonEnvConfig)


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
    #: Scoring a policy on held-out prompts (``rlcore eval`` and the trainer's evaluations).
    eval: EvalConfig = field(default_factory=EvalConfig)
    #: Free-form sections of plugins, keyed by plugin name (``plugin_config.<name>.<key>``).
    plugin_config: dict[str, Any] = field(default_factory=dict)
