"""``rlcore convert-config``: a verl trainer config or a TRL ``GRPOConfig`` turned into an rlcore config.

Each source key either maps to an rlcore key (:data:`VERL_MAP`, :data:`TRL_MAP`; docs/migrating.md
holds the same tables) or is listed as unmapped with the reason, in the written YAML's header and in
:attr:`Conversion.unmapped`: nothing is dropped silently. Batch sizes are converted from the
source's units (verl: prompts over all GPUs; TRL: completions per device) to rlcore's (prompts and
samples per rank).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import yaml

from rlcore import convert_knobs as knobs
from rlcore.config.schema import AdvEstimator, LossAgg, PolicyLoss, Truncation
from rlcore.errors import ConfigError

SOURCES = ("verl", "trl")

#: rlcore's default LoRA targets (``all-linear`` in verl / TRL means the same projections).
_ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Conversion:
    """The result of a conversion: dotted rlcore keys, the source keys they came from, what is left."""

    source: str
    values: dict[str, Any] = field(default_factory=dict)
    mapped: dict[str, str] = field(default_factory=dict)  # source key -> rlcore key(s)
    unmapped: dict[str, tuple[Any, str]] = field(default_factory=dict)  # source key -> (value, reason)
    notes: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any, src: str) -> None:
        self.values[key] = value
        self.mapped[src] = key if src not in self.mapped else f"{self.mapped[src]}, {key}"

    def skip(self, src: str, value: Any, reason: str) -> None:
        self.unmapped[src] = (value, reason)

    def recorder(self, flat: dict[str, Any], handled: set[str]) -> tuple[Callable, Callable]:
        """``(take, drop)``: map a source key to an rlcore value, or list it as unmapped with a reason;
        both mark the source key as handled."""
        def take(src: str, key: str, value: Any) -> None:
            handled.add(src)
            self.set(key, value, src)

        def drop(src: str, reason: str) -> None:
            handled.add(src)
            self.skip(src, flat.get(src), reason)

        return take, drop

    def tree(self) -> dict:
        out: dict = {}
        for key, value in sorted(self.values.items()):
            node = out
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return out

    def to_yaml(self, origin: str) -> str:
        lines = [f"# Converted by `rlcore convert-config --from {self.source}` from {os.path.basename(origin)}.",
                 f"# {len(self.mapped)} key(s) mapped; {len(self.unmapped)} key(s) have no rlcore counterpart:"]
        for key, (value, reason) in sorted(self.unmapped.items()):
            lines.append(f"#   {key} = {_short(value)}: {reason}")
        lines += [f"# note: {n}" for n in self.notes]
        body = yaml.safe_dump(self.tree(), sort_keys=True, default_flow_style=False)
        return "\n".join(lines) + "\n" + body


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; an empty mapping is kept as a value."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): tree}


def apply_overrides(flat: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Hydra-style ``key=value`` / ``+key=value`` / ``++key=value`` overrides of a run script, on a flat config."""
    out = dict(flat)
    for item in overrides:
        if "=" not in item:
            raise ConfigError([f"override {item!r} is not of the form key=value"])
        key, raw = item.split("=", 1)
        key = key.lstrip("+")
        value = _scalar(raw)
        for old in [k for k in out if k.startswith(key + ".")]:  # a whole subtree replaced by a value
            del out[old]
        out.update(flatten(value, key + ".") if isinstance(value, dict) else {key: value})
    return out


def _scalar(raw: str) -> Any:
    """A command-line value as Hydra reads it: YAML, plus ``1e-6`` as a number (YAML 1.1 wants ``1.0e-6``)."""
    if raw == "":
        return None
    value = yaml.safe_load(raw)
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            return value
    return value


def read_source(path: str) -> dict:
    """A YAML or JSON mapping from ``path`` (a TRL config saved with ``to_json_string`` is JSON)."""
    if not os.path.exists(path):
        raise ConfigError([f"convert-config: no such file: {path}"])
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError as e:
        raise ConfigError([f"convert-config: {path} is not UTF-8 text (a binary file?): byte {e.start} cannot be "
                           "decoded; give the YAML or JSON config file"]) from None
    except OSError as e:
        raise ConfigError([f"convert-config: cannot read {path}: {e.strerror or e}"]) from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise ConfigError([f"convert-config: {path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {e}"])
    if not isinstance(data, dict):
        raise ConfigError([f"convert-config: the top level of {path} must be a mapping, got {type(data).__name__}"])
    return data


def _interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


#: Keys of each source whose value the conversion does arithmetic with: whole numbers (or null).
WHOLE_KEYS = {
    "verl": ("trainer.n_gpus_per_node", "trainer.nnodes", "actor_rollout_ref.rollout.n", "data.train_batch_size",
             "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
             "actor_rollout_ref.rollout.top_k", "actor_rollout_ref.actor.optim.lr_warmup_steps",
             "trainer.total_training_steps", "actor_rollout_ref.model.lora_rank",
             "algorithm.filter_groups.max_num_gen_batches", "trainer.save_freq", "trainer.test_freq"),
    "trl": ("per_device_train_batch_size", "num_generations", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size", "top_k", "max_steps", "save_steps", "eval_steps"),
}


def check_numbers(flat: dict[str, Any], source: str) -> None:
    """:raises ConfigError: a key of :data:`WHOLE_KEYS` holds something other than a number, e.g.
    an interpolation left unresolved (``${oc.env:BS}``), naming each such key."""
    problems = []
    for key in WHOLE_KEYS[source]:
        value = flat.get(key)
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            continue
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            continue
        why = ("an interpolation that cannot be resolved from the file and the overrides" if _interpolation(value)
               else "not a whole number")
        problems.append(f"convert-config: {key} = {value!r} is {why}; give the number (in the file or as an "
                        f"override {key}=N)")
    if problems:
        raise ConfigError(problems)


def _resolve(flat: dict[str, Any]) -> dict[str, Any]:
    """Resolve whole-value ``${a.b}`` and ``${oc.select:a.b,default}`` interpolations (verl's generated
    config uses them) against ``flat``; relative or composite ones stay as they are."""
    out = dict(flat)
    for _ in range(5):
        changed = False
        for k, v in out.items():
            if not (_interpolation(v) and v.startswith("${") and v.endswith("}") and v.count("${") == 1):
                continue
            ref, has_default, default = v[2:-1], False, None
            if ref.startswith("oc.select:"):
                ref, _, raw = ref[len("oc.select:"):].partition(",")
                has_default, default = bool(raw), yaml.safe_load(raw.strip().strip('"')) if raw else None
            if ref.startswith((".", "oc.")):
                continue
            if ref in out and not _interpolation(out[ref]):
                out[k], changed = out[ref], True
            elif ref not in out and has_default:
                out[k], changed = default, True
        if not changed:
            break
    return out


# --------------------------------------------------------------------------------------------- verl

#: verl key -> (rlcore key, note). Keys handled by :func:`_verl_special` are listed in docs/migrating.md too.
VERL_MAP: dict[str, tuple[str, str]] = {
    "data.train_files": ("data.train_files", ""),
    "data.val_files": ("data.val_files", ""),
    "data.prompt_key": ("data.prompt_key", ""),
    "data.max_prompt_length": ("data.max_prompt_length", ""),
    "data.max_response_length": ("ppo.generation.max_new_tokens", ""),
    "data.shuffle": ("data.shuffle", ""),
    "data.filter_overlong_prompts": ("data.filter_overlong_prompts", ""),
    "data.filter_overlong_prompts_workers": ("data.preprocess_workers", ""),
    "data.dataloader_num_workers": ("data.num_workers", ""),
    "data.custom_cls.path": ("data.custom_cls.path", ""),
    "data.custom_cls.name": ("data.custom_cls.name", ""),
    "data.seed": ("trainer.seed", ""),
    "actor_rollout_ref.model.path": ("actor.model_path", ""),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("actor.gradient_checkpointing", ""),
    "actor_rollout_ref.actor.use_torch_compile": ("actor.compile", ""),
    "actor_rollout_ref.actor.optim.lr": ("actor.lr", ""),
    "actor_rollout_ref.actor.optim.weight_decay": ("actor.weight_decay", ""),
    "actor_rollout_ref.actor.grad_clip": ("actor.grad_clip", ""),
    "actor_rollout_ref.actor.ppo_epochs": ("ppo.ppo_epochs", ""),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("ppo.micro_batch_size", "samples per rank"),
    "actor_rollout_ref.actor.clip_ratio_high": ("ppo.cliprange_high", ""),
    "actor_rollout_ref.actor.clip_ratio_c": ("ppo.dual_clip", ""),
    "actor_rollout_ref.actor.loss_agg_mode": ("ppo.loss_agg", ""),
    "actor_rollout_ref.actor.entropy_coeff": ("ppo.entropy_coeff", ""),
    "actor_rollout_ref.actor.policy_loss.loss_mode": ("ppo.policy_loss", ""),
    "actor_rollout_ref.rollout.n": ("ppo.generation.n", ""),
    "actor_rollout_ref.rollout.temperature": ("ppo.generation.temperature", ""),
    "actor_rollout_ref.rollout.top_p": ("ppo.generation.top_p", ""),
    "actor_rollout_ref.rollout.response_length": ("ppo.generation.max_new_tokens", ""),
    "actor_rollout_ref.rollout.prompt_length": ("data.max_prompt_length", ""),
    "critic.optim.lr": ("critic.lr", ""),
    "critic.optim.weight_decay": ("critic.weight_decay", ""),
    "critic.grad_clip": ("critic.grad_clip", ""),
    "critic.model.path": ("critic.model_path", ""),
    "critic.model.enable_gradient_checkpointing": ("critic.gradient_checkpointing", ""),
    "critic.cliprange_value": ("ppo.cliprange_value", ""),
    "reward_model.enable": ("reward_model.enable", ""),
    "reward_model.model.path": ("reward_model.path", ""),
    "reward_model.micro_batch_size_per_gpu": ("reward_model.micro_batch_size", ""),
    "reward_model.max_length": ("reward_model.max_length", ""),
    "custom_reward_function.path": ("custom_reward_function.path", ""),
    "custom_reward_function.name": ("custom_reward_function.name", ""),
    "algorithm.gamma": ("algorithm.gamma", ""),
    "algorithm.lam": ("algorithm.lam", ""),
    "algorithm.norm_adv_by_std_in_grpo": ("algorithm.norm_adv_by_std", ""),
    "algorithm.filter_groups.enable": ("algorithm.dynamic_sampling.enable", ""),
    "trainer.total_training_steps": ("trainer.max_steps", ""),
    "trainer.default_local_dir": ("trainer.output_dir", ""),
    "trainer.n_gpus_per_node": ("trainer.nproc_per_node", ""),
    "trainer.max_actor_ckpt_to_keep": ("trainer.save_total_limit", ""),
}

_ESTIMATORS = AdvEstimator.values()
#: transformers' schedules rlcore's lr_scheduler takes (the ones that step without a validation metric)
_HF_SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial",
                 "inverse_sqrt", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay")
_LOSS_AGG = LossAgg.values()
_KL = ("k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs", "k1+", "k3+")
_OVERLONG = ("reward_model.overlong_buffer.", "reward_model.reward_kwargs.overlong_buffer_cfg.",
             "reward.reward_kwargs.overlong_buffer_cfg.")


def convert_verl(cfg: dict, overrides: Optional[list[str]] = None) -> Conversion:
    """Convert verl's trainer config (e.g. the generated ``ppo_trainer.yaml``), with a run script's overrides."""
    flat = _resolve(apply_overrides(flatten(cfg), list(overrides or [])))
    check_numbers(flat, "verl")
    conv = Conversion("verl")
    get = flat.get
    world = int(get("trainer.n_gpus_per_node") or 1) * int(get("trainer.nnodes") or 1)
    n = int(get("actor_rollout_ref.rollout.n") or 1)
    handled: set[str] = set()
    take, drop = conv.recorder(flat, handled)

    s = _Source(conv, flat, get, take, drop, handled, world, n)
    _verl_algorithm(s)
    _verl_kl(s)
    _verl_batches(s)
    _verl_sampling(s)
    _verl_schedule(s)
    _verl_offload(s)
    _verl_lora(s)
    _verl_dapo(s)
    _verl_trainer(s)
    knobs.verl_optimizer(s)
    knobs.verl_micro_batches(s)
    knobs.verl_rollout(s)
    knobs.verl_critic_loss(s)
    _verl_plain(s)
    return conv


@dataclass
class _Source:
    """What the sections of :func:`convert_verl` share: the conversion, the flat source and its recorders."""

    conv: "Conversion"
    flat: dict[str, Any]
    get: Callable[..., Any]
    take: Callable[..., None]
    drop: Callable[..., None]
    handled: set[str]
    world: int
    n: int


def _verl_algorithm(s: "_Source") -> None:
    """Algorithm."""
    flat, get, take, drop = s.flat, s.get, s.take, s.drop
    est = get("algorithm.adv_estimator")
    if est is not None:
        if est in _ESTIMATORS:
            take("algorithm.adv_estimator", "algorithm.adv_estimator", est)
        else:
            drop("algorithm.adv_estimator", f"estimator {est!r} has no rlcore counterpart "
                                            f"({', '.join(_ESTIMATORS)})")
    low = get("actor_rollout_ref.actor.clip_ratio_low")
    clip = get("actor_rollout_ref.actor.clip_ratio")
    if low is not None:
        take("actor_rollout_ref.actor.clip_ratio_low", "ppo.cliprange", low)
        if clip is not None:
            drop("actor_rollout_ref.actor.clip_ratio", "superseded by clip_ratio_low (ppo.cliprange)")
    elif clip is not None:
        take("actor_rollout_ref.actor.clip_ratio", "ppo.cliprange", clip)
    # verl applies its dual clip (clip_ratio_c) to the vanilla loss only
    if get("actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla") not in (None, "vanilla"):
        if "actor_rollout_ref.actor.clip_ratio_c" in flat:
            drop("actor_rollout_ref.actor.clip_ratio_c", "dual clip applies to the vanilla policy loss only")
    mode = get("actor_rollout_ref.actor.policy_loss.loss_mode")
    if mode is not None and mode not in PolicyLoss.values():
        drop("actor_rollout_ref.actor.policy_loss.loss_mode", f"policy loss {mode!r} has no rlcore counterpart "
                                                              f"({', '.join(PolicyLoss.values())})")
    agg = get("actor_rollout_ref.actor.loss_agg_mode")
    if agg is not None and agg not in _LOSS_AGG:
        drop("actor_rollout_ref.actor.loss_agg_mode", f"loss aggregation {agg!r} has no rlcore counterpart")


def _verl_kl(s: "_Source") -> None:
    """KL: in the loss (actor.use_kl_loss) or in the reward (algorithm.use_kl_in_reward)."""
    conv, flat, get, take, drop, handled = s.conv, s.flat, s.get, s.take, s.drop, s.handled
    kl_loss = bool(get("actor_rollout_ref.actor.use_kl_loss"))
    kl_reward = bool(get("algorithm.use_kl_in_reward"))
    for k in ("actor_rollout_ref.actor.use_kl_loss", "algorithm.use_kl_in_reward"):
        if k in flat:
            handled.add(k)
            conv.mapped[k] = "ppo.kl_in_reward, ppo.kl_coeff"
    kl_keys = ["actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_type", "algorithm.kl_penalty",
               "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.horizon",
               "algorithm.kl_ctrl.target_kl"]
    if kl_loss and kl_reward:
        conv.notes.append("verl had both use_kl_loss and use_kl_in_reward on; rlcore has one KL term: the KL loss "
                          "was kept (algorithm.kl_* listed above)")
    if kl_loss:
        conv.values["ppo.kl_in_reward"] = False
        take("actor_rollout_ref.actor.kl_loss_coef", "ppo.kl_coeff", get("actor_rollout_ref.actor.kl_loss_coef", 0.0))
        _kl_type(conv, take, drop, "actor_rollout_ref.actor.kl_loss_type", get("actor_rollout_ref.actor.kl_loss_type"))
    elif kl_reward:
        conv.values["ppo.kl_in_reward"] = True
        take("algorithm.kl_ctrl.kl_coef", "ppo.kl_coeff", get("algorithm.kl_ctrl.kl_coef", 0.001))
        _kl_type(conv, take, drop, "algorithm.kl_penalty", get("algorithm.kl_penalty"))
        if get("algorithm.kl_ctrl.type") in ("fixed", "adaptive"):
            take("algorithm.kl_ctrl.type", "ppo.kl_ctrl", get("algorithm.kl_ctrl.type"))
        if get("algorithm.kl_ctrl.type") == "adaptive":
            take("algorithm.kl_ctrl.horizon", "ppo.kl_horizon", get("algorithm.kl_ctrl.horizon"))
            take("algorithm.kl_ctrl.target_kl", "ppo.kl_target", get("algorithm.kl_ctrl.target_kl"))
    else:
        conv.values["ppo.kl_coeff"] = 0.0
        conv.values["algorithm.use_reference"] = False
    for k in kl_keys:
        if k in flat and k not in handled:
            drop(k, "its KL term is off in the source (use_kl_loss / use_kl_in_reward)")


def _verl_batches(s: "_Source") -> None:
    """Batch sizes: verl counts prompts over all GPUs; rlcore counts prompts (rollout) and samples."""
    conv, flat, get, take, drop, handled, world, n = s.conv, s.flat, s.get, s.take, s.drop, s.handled, s.world, s.n
    # (mini-batch) per rank.
    tbs = get("data.train_batch_size")
    if tbs is not None:
        take("data.train_batch_size", "ppo.rollout_batch_size", max(1, int(tbs) // world))
        if int(tbs) % world:
            conv.notes.append(f"data.train_batch_size={tbs} does not split over {world} GPUs: rounded down per rank")
    mbs = get("actor_rollout_ref.actor.ppo_mini_batch_size")
    if mbs is not None:
        take("actor_rollout_ref.actor.ppo_mini_batch_size", "ppo.mini_batch_size", max(1, int(mbs) * n // world))
    if get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu") is None and \
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu" in flat:
        drop("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "null: rlcore derives the micro-batch from "
                                                                      "trainer.gradient_accumulation_steps")
    nnodes = get("trainer.nnodes")
    if nnodes is not None and int(nnodes) > 1:
        drop("trainer.nnodes", "several nodes: launch with torchrun across the nodes (docs/distributed.md); the "
                               "batch sizes above are per rank over all nodes")
    elif nnodes is not None:
        handled.add("trainer.nnodes")
        conv.mapped["trainer.nnodes"] = "(one node: trainer.nproc_per_node)"


def _verl_sampling(s: "_Source") -> None:
    """Sampling."""
    conv, flat, get, take, handled = s.conv, s.flat, s.get, s.take, s.handled
    top_k = get("actor_rollout_ref.rollout.top_k")
    if top_k is not None:
        take("actor_rollout_ref.rollout.top_k", "ppo.generation.top_k", max(0, int(top_k)))
    if get("actor_rollout_ref.rollout.do_sample") is False:
        take("actor_rollout_ref.rollout.do_sample", "ppo.generation.temperature", 0.0)
    elif "actor_rollout_ref.rollout.do_sample" in flat:
        handled.add("actor_rollout_ref.rollout.do_sample")
        conv.mapped["actor_rollout_ref.rollout.do_sample"] = "(sampling: ppo.generation.temperature)"
    name = get("actor_rollout_ref.rollout.name")
    if name is not None:
        take("actor_rollout_ref.rollout.name", "actor.rollout_backend", "hf" if name == "hf" else "auto")
        if name not in ("hf",):
            conv.notes.append(f"rollout.name={name}: rlcore generates with its own engine (actor.rollout_backend=auto)")


def _verl_schedule(s: "_Source") -> None:
    """Optimizer schedule."""
    conv, flat, get, take, drop, handled = s.conv, s.flat, s.get, s.take, s.drop, s.handled
    style = get("actor_rollout_ref.actor.optim.lr_scheduler_type") or get("actor_rollout_ref.actor.optim.warmup_style")
    for k in ("actor_rollout_ref.actor.optim.lr_scheduler_type", "actor_rollout_ref.actor.optim.warmup_style"):
        if k in flat and get(k) is not None:
            if style in ("constant", "cosine", "linear"):
                take(k, "actor.lr_scheduler", style)
            else:
                drop(k, f"schedule {style!r} has no rlcore counterpart (constant, cosine, linear)")
    warm = get("actor_rollout_ref.actor.optim.lr_warmup_steps")
    if warm is not None and int(warm) >= 0:
        take("actor_rollout_ref.actor.optim.lr_warmup_steps", "actor.warmup_steps", int(warm))
        if "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio" in flat:
            drop("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "superseded by lr_warmup_steps")
    elif "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio" in flat:
        ratio = float(get("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio") or 0.0)
        steps = get("trainer.total_training_steps")
        if ratio == 0.0 or steps:
            take("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "actor.warmup_steps",
                 int(ratio * int(steps or 0)))
        else:
            drop("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "a ratio of the total steps, which are not "
                                                                         "given (set actor.warmup_steps)")
        if "actor_rollout_ref.actor.optim.lr_warmup_steps" in flat:
            handled.add("actor_rollout_ref.actor.optim.lr_warmup_steps")
            conv.mapped["actor_rollout_ref.actor.optim.lr_warmup_steps"] = "(-1: the ratio is used)"
    clr = get("critic.optim.lr_scheduler_type") or get("critic.optim.warmup_style")
    for k in ("critic.optim.lr_scheduler_type", "critic.optim.warmup_style"):
        if k in flat and get(k) is not None and clr in ("constant", "cosine", "linear"):
            take(k, "critic.lr_scheduler", clr)


def _verl_offload(s: "_Source") -> None:
    """FSDP offload: rlcore offloads parameters, gradients and optimizer state together."""
    flat, get, take, drop = s.flat, s.get, s.take, s.drop
    p_off = get("actor_rollout_ref.actor.fsdp_config.param_offload")
    o_off = get("actor_rollout_ref.actor.fsdp_config.optimizer_offload")
    if p_off is not None or o_off is not None:
        if bool(p_off) == bool(o_off):
            for k in ("actor_rollout_ref.actor.fsdp_config.param_offload",
                      "actor_rollout_ref.actor.fsdp_config.optimizer_offload"):
                if k in flat:
                    take(k, "actor.fsdp.cpu_offload", bool(p_off))
        else:
            for k in ("actor_rollout_ref.actor.fsdp_config.param_offload",
                      "actor_rollout_ref.actor.fsdp_config.optimizer_offload"):
                if k in flat:
                    drop(k, "rlcore offloads parameters and optimizer state together (actor.fsdp.cpu_offload)")


def _verl_lora(s: "_Source") -> None:
    """LoRA."""
    get, take = s.get, s.take
    rank = get("actor_rollout_ref.model.lora_rank")
    if rank is not None:
        take("actor_rollout_ref.model.lora_rank", "actor.lora.rank", int(rank))
        if int(rank) > 0:
            for src, key in (("actor_rollout_ref.model.lora_alpha", "actor.lora.alpha"),):
                if get(src) is not None:
                    take(src, key, get(src))
            tm = get("actor_rollout_ref.model.target_modules")
            if tm is not None:
                take("actor_rollout_ref.model.target_modules", "actor.lora.target_modules",
                     _ALL_LINEAR if tm == "all-linear" else list(tm) if isinstance(tm, list) else [tm])


def _verl_dapo(s: "_Source") -> None:
    """DAPO: dynamic sampling rounds and overlong shaping."""
    conv, flat, get, take, drop, handled = s.conv, s.flat, s.get, s.take, s.drop, s.handled
    mng = get("algorithm.filter_groups.max_num_gen_batches")
    if mng is not None and get("algorithm.filter_groups.enable"):
        take("algorithm.filter_groups.max_num_gen_batches", "algorithm.dynamic_sampling.max_rounds",
             int(mng) - 1 if int(mng) > 0 else 16)
        if int(mng) <= 0:
            conv.notes.append("filter_groups.max_num_gen_batches <= 0 (no cap in verl): capped at 16 extra rounds")
    metric = get("algorithm.filter_groups.metric")
    if metric is not None and get("algorithm.filter_groups.enable"):
        if metric in ("acc", "score"):
            handled.add("algorithm.filter_groups.metric")
            conv.mapped["algorithm.filter_groups.metric"] = "(rlcore filters on the reward's score)"
        else:
            drop("algorithm.filter_groups.metric", "rlcore filters groups on the reward backend's score")
    for prefix in _OVERLONG:
        if get(prefix + "enable"):
            take(prefix + "len", "algorithm.overlong_buffer.length", int(get(prefix + "len")))
            take(prefix + "penalty_factor", "algorithm.overlong_buffer.penalty_factor",
                 float(get(prefix + "penalty_factor", 1.0)))
            handled.add(prefix + "enable")
            conv.mapped[prefix + "enable"] = "algorithm.overlong_buffer.length"
            if (prefix + "log") in flat:
                drop(prefix + "log", "overlong metrics are always logged (reward/overlong_*)")
        elif prefix + "enable" in flat:
            for k in [k for k in flat if k.startswith(prefix)]:
                drop(k, "overlong shaping is off in the source")


def _verl_trainer(s: "_Source") -> None:
    """Trainer."""
    conv, get, take, drop, handled = s.conv, s.get, s.take, s.drop, s.handled
    for src, key in (("trainer.save_freq", "trainer.save_steps"), ("trainer.test_freq", "trainer.eval_steps")):
        if get(src) is not None:
            take(src, key, max(0, int(get(src))))
    resume = get("trainer.resume_mode")
    if resume is not None:
        if resume in ("auto", "disable"):
            take("trainer.resume_mode", "trainer.resume", resume)
        elif resume == "resume_path" and get("trainer.resume_from_path"):
            take("trainer.resume_from_path", "trainer.resume", get("trainer.resume_from_path"))
            handled.add("trainer.resume_mode")
            conv.mapped["trainer.resume_mode"] = "trainer.resume"
    if get("trainer.total_training_steps") is None and get("trainer.total_epochs") is not None:
        drop("trainer.total_epochs", "rlcore counts RL steps: set trainer.max_steps "
                                     "(= epochs x prompts / data.train_batch_size)")
    truncation = get("data.truncation")
    if truncation is not None:
        if truncation in Truncation.values():
            take("data.truncation", "data.truncation", truncation)
        else:
            drop("data.truncation", f"truncation {truncation!r} has no rlcore counterpart (error, left, right)")


def _verl_plain(s: "_Source") -> None:
    """The plain one-to-one keys."""
    conv, flat, get, take, drop, handled = s.conv, s.flat, s.get, s.take, s.drop, s.handled
    for src, (key, _) in VERL_MAP.items():
        if src in flat and src not in handled:
            value = get(src)
            if value is None or _interpolation(value):
                if value is not None:
                    drop(src, f"an unresolved interpolation {value}")
                else:
                    handled.add(src)
                    conv.mapped[src] = f"(null: rlcore's default {key})"
                continue
            if key == "trainer.max_steps" and int(value) <= 0:
                drop(src, "not a positive step count")
                continue
            take(src, key, value)
    for key in ("data.train_files", "data.val_files"):
        v = conv.values.get(key)
        if isinstance(v, str):
            conv.values[key] = [v]
    if conv.values.get("ppo.policy_loss", "vanilla") != "vanilla":
        conv.values.pop("ppo.dual_clip", None)
    if "ppo.dual_clip" in conv.values and not (conv.values["ppo.dual_clip"] or 0) > 1:
        conv.values.pop("ppo.dual_clip")
        conv.skip("actor_rollout_ref.actor.clip_ratio_c", get("actor_rollout_ref.actor.clip_ratio_c"),
                  "a dual-clip constant must be > 1")
        conv.mapped.pop("actor_rollout_ref.actor.clip_ratio_c", None)
    if conv.values.get("algorithm.adv_estimator", "gae") != "gae":  # no critic: its settings are not read
        _unmap(conv, flat, ("critic.", "ppo.cliprange_value"), "no critic is trained with this estimator")
    if not conv.values.get("reward_model.enable"):
        _unmap(conv, flat, ("reward_model.",), "the reward model is off")
    critic, rm = conv.values.get("algorithm.adv_estimator", "gae") == "gae", bool(conv.values.get("reward_model.enable"))
    for src in flat:
        if src not in handled and src not in conv.mapped:
            conv.skip(src, flat[src], _verl_reason(src, critic, rm))


def _unmap(conv: Conversion, flat: dict[str, Any], prefixes: tuple[str, ...], reason: str) -> None:
    """Move the mapped keys whose rlcore key starts with one of ``prefixes`` back to the unmapped list."""
    for src, key in list(conv.mapped.items()):
        if key.startswith(prefixes) and key in conv.values:
            conv.values.pop(key)
            conv.mapped.pop(src)
            conv.skip(src, flat.get(src), reason)


def _kl_type(conv: Conversion, take: Callable, drop: Callable, src: str, value: Any) -> None:
    if value is None:
        return
    if value == "full":
        drop(src, "the full-vocabulary KL has no rlcore counterpart (sampled-token estimators only)")
    elif value in _KL:
        take(src, "ppo.kl_estimator", value)
    else:
        drop(src, f"KL estimator {value!r} has no rlcore counterpart ({', '.join(_KL)})")


def _verl_reason(key: str, critic: bool = True, reward_model: bool = True) -> str:
    """Why a verl key has no counterpart (by its section; ``critic``, ``reward_model``: whether the run has one)."""
    if key.startswith("critic.") and not critic:
        return "no critic is trained with this estimator"
    if key.startswith("reward_model.") and not reward_model:
        return "the reward model is off"
    if knobs.verl_reason(key):
        return knobs.verl_reason(key)
    if key.startswith("actor_rollout_ref.rollout."):
        return "a setting of verl's rollout server (vLLM/SGLang); rlcore's engine is set with actor.rollout_engine"
    if key.startswith(("actor_rollout_ref.ref.", "actor_rollout_ref.actor.fsdp_config.", "critic.model.fsdp_config.",
                       "critic.fsdp")):
        return "FSDP/worker layout detail: rlcore shards with FSDP2 over all ranks (actor.fsdp, fsdp)"
    if key.startswith(("actor_rollout_ref.actor.checkpoint.", "critic.checkpoint.")):
        return "rlcore checkpoints hold model, optimizer and data position (docs/checkpoints.md)"
    if key.startswith(("trainer.", "ray_init.", "ray_kwargs.", "global_profiler.", "transfer_queue.")):
        return "run orchestration or logging of verl (Ray, loggers, profiler): see docs/migrating.md"
    if "dynamic_bsz" in key or "max_token_len" in key or "use_remove_padding" in key:
        return "rlcore cuts padding itself (ppo.trim_padding, ppo.group_by_length)"
    return "no rlcore counterpart"


# --------------------------------------------------------------------------------------------- TRL

#: TRL ``GRPOConfig`` (and TrlParser script/model argument) key -> rlcore key.
TRL_MAP: dict[str, str] = {
    "learning_rate": "actor.lr",
    "weight_decay": "actor.weight_decay",
    "warmup_steps": "actor.warmup_steps",
    "max_grad_norm": "actor.grad_clip",
    "gradient_checkpointing": "actor.gradient_checkpointing",
    "seed": "trainer.seed",
    "output_dir": "trainer.output_dir",
    "save_total_limit": "trainer.save_total_limit",
    "logging_steps": "trainer.log_steps",
    "max_prompt_length": "data.max_prompt_length",
    "max_completion_length": "ppo.generation.max_new_tokens",
    "num_generations": "ppo.generation.n",
    "temperature": "ppo.generation.temperature",
    "top_p": "ppo.generation.top_p",
    "beta": "ppo.kl_coeff",
    "epsilon": "ppo.cliprange",
    "epsilon_high": "ppo.cliprange_high",
    "num_iterations": "ppo.ppo_epochs",
    "mask_truncated_completions": "algorithm.mask_truncated",
    "model_name_or_path": "actor.model_path",
    "lora_r": "actor.lora.rank",
    "lora_alpha": "actor.lora.alpha",
    "lora_dropout": "actor.lora.dropout",
}

#: TRL ``loss_type`` -> ``ppo.loss_agg`` (and ``ppo.policy_loss`` for cispo).
TRL_LOSS_TYPES = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
                  "dapo": "token-mean", "cispo": "token-mean"}


def convert_trl(cfg: dict, overrides: Optional[list[str]] = None) -> Conversion:
    """Convert a TRL ``GRPOConfig`` as saved by TRL (``to_json_string``, or a TrlParser YAML)."""
    # TRL stores every field of TrainingArguments; nested dicts (e.g. model_init_kwargs) are kept whole
    flat = apply_overrides(flatten(cfg), list(overrides or []))
    check_numbers(flat, "trl")
    conv = Conversion("trl")
    get = flat.get
    handled: set[str] = set()
    take, drop = conv.recorder(flat, handled)

    conv.values["algorithm.adv_estimator"] = "grpo"
    conv.values["ppo.kl_in_reward"] = False  # TRL's KL is a loss term (k3 estimator)
    conv.values["ppo.kl_estimator"] = "k3"
    if not get("beta"):
        conv.values["algorithm.use_reference"] = False
    _trl_loss(conv, flat, take, drop, handled)
    _trl_batches(conv, flat, take, drop, handled)
    sched = get("lr_scheduler_type")
    if sched is not None:  # rlcore's schedules are transformers' (constant + warmup steps: constant_with_warmup)
        if sched in _HF_SCHEDULES:
            take("lr_scheduler_type", "actor.lr_scheduler", "constant" if sched == "constant_with_warmup" else sched)
        else:
            drop("lr_scheduler_type", f"schedule {sched!r} has no rlcore counterpart ({', '.join(_HF_SCHEDULES)})")
    knobs.trl_optimizer(conv, flat, take, handled)
    if "top_k" in flat:
        take("top_k", "ppo.generation.top_k", max(0, int(get("top_k") or 0)))
    _trl_steps(conv, flat, take, drop, handled)
    if get("bf16"):
        take("bf16", "fsdp.param_dtype", "bf16")
    elif "bf16" in flat:
        handled.add("bf16")
        conv.mapped["bf16"] = "(off: fsdp.param_dtype default)"
    _trl_peft(conv, flat, take, drop, handled)
    for src, key in TRL_MAP.items():
        if src in flat and src not in handled:
            value = get(src)
            if value is None:
                handled.add(src)
                conv.mapped[src] = f"(null: rlcore's default {key})"
                continue
            take(src, key, value)
    if "actor.lora.rank" in conv.values and not (get("use_peft") or "use_peft" not in flat):
        conv.values.pop("actor.lora.rank")
        for k in ("actor.lora.alpha", "actor.lora.dropout"):
            conv.values.pop(k, None)
    if conv.values.get("ppo.kl_coeff") == 0:
        conv.values["algorithm.use_reference"] = False
    if conv.values.get("ppo.cliprange_high") is None:
        conv.values.pop("ppo.cliprange_high", None)
    for src in flat:
        if src not in handled and src not in conv.mapped:
            conv.skip(src, flat[src], _trl_reason(src))
    return conv


def _trl_loss(conv: Conversion, flat: dict, take, drop, handled: set[str]) -> None:
    """TRL's loss type, importance-sampling level and reward scaling."""
    get = flat.get
    loss_type = get("loss_type")
    if loss_type is not None:
        if loss_type in TRL_LOSS_TYPES:
            take("loss_type", "ppo.loss_agg", TRL_LOSS_TYPES[loss_type])
            if loss_type == "cispo":
                conv.values["ppo.policy_loss"] = "cispo"
        else:
            drop("loss_type", f"loss type {loss_type!r} has no rlcore counterpart ({', '.join(TRL_LOSS_TYPES)})")
    level = get("importance_sampling_level")
    if level is not None:
        if level == "sequence":
            if loss_type == "cispo":
                drop("importance_sampling_level", "sequence-level ratios with cispo have no rlcore counterpart")
            else:
                take("importance_sampling_level", "ppo.policy_loss", "gspo")
        elif level == "token":
            handled.add("importance_sampling_level")
            conv.mapped["importance_sampling_level"] = "(token: ppo.policy_loss default)"
        else:
            drop("importance_sampling_level", f"{level!r} has no rlcore counterpart (token, sequence)")
    scale = get("scale_rewards")
    if scale is not None:
        if scale in (True, "group", "true"):
            take("scale_rewards", "algorithm.norm_adv_by_std", True)
        elif scale in (False, "none", "false"):
            take("scale_rewards", "algorithm.norm_adv_by_std", False)
        else:
            drop("scale_rewards", f"{scale!r}: rlcore scales advantages by the group's std or not at all")


def _trl_batches(conv: Conversion, flat: dict, take, drop, handled: set[str]) -> None:
    """Batch sizes: TRL counts completions per device; one generation feeds ``steps_per_generation`` steps."""
    get = flat.get
    per_dev = get("per_device_train_batch_size")
    n = int(get("num_generations") or 8)
    accum = int(get("gradient_accumulation_steps") or 1)
    spg = get("steps_per_generation") or accum
    if per_dev is not None:
        completions = int(per_dev) * int(spg)
        take("per_device_train_batch_size", "ppo.rollout_batch_size", max(1, completions // n))
        conv.set("ppo.micro_batch_size", int(per_dev), "per_device_train_batch_size")
        conv.set("ppo.mini_batch_size", int(per_dev) * accum, "gradient_accumulation_steps")
        handled.update({"gradient_accumulation_steps", "steps_per_generation"})
        conv.mapped.setdefault("steps_per_generation", "ppo.rollout_batch_size")
        if completions % n:
            conv.notes.append(f"per_device_train_batch_size x steps_per_generation = {completions} completions is "
                              f"not a multiple of num_generations={n}: rounded down")
    if get("generation_batch_size") is not None:
        drop("generation_batch_size", "rlcore sizes the rollout by ppo.rollout_batch_size (from "
                                      "per_device_train_batch_size x steps_per_generation)")


def _trl_steps(conv: Conversion, flat: dict, take, drop, handled: set[str]) -> None:
    """``max_steps`` and the save/eval intervals with their strategies."""
    get = flat.get
    steps = get("max_steps")
    if steps is not None:
        if int(steps) > 0:
            take("max_steps", "trainer.max_steps", int(steps))
            if "num_train_epochs" in flat:
                drop("num_train_epochs", "superseded by max_steps")
        else:
            drop("max_steps", "-1: TRL trains num_train_epochs; set trainer.max_steps")
    for src, strat, key in (("save_steps", "save_strategy", "trainer.save_steps"),
                            ("eval_steps", "eval_strategy", "trainer.eval_steps")):
        if get(strat) == "no":
            take(strat, key, 0)
            if src in flat:
                drop(src, f"{strat} is 'no'")
        elif get(src) is not None:
            value = get(src)
            if isinstance(value, float) and value < 1:
                drop(src, "a fraction of the total steps: give trainer." + key.split(".")[1] + " in steps")
            else:
                take(src, key, int(value))
            if strat in flat:
                handled.add(strat)
                conv.mapped[strat] = key


def _trl_peft(conv: Conversion, flat: dict, take, drop, handled: set[str]) -> None:
    """``use_peft`` and the LoRA target modules (rank, alpha and dropout go through ``TRL_MAP``)."""
    get = flat.get
    if "use_peft" in flat:
        handled.add("use_peft")
        conv.mapped["use_peft"] = "actor.lora.rank"
        if not get("use_peft"):
            for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"):
                if k in flat:
                    drop(k, "use_peft is off")
    if get("use_peft") or ("use_peft" not in flat and get("lora_r")):
        tm = get("lora_target_modules")
        if tm is not None:
            take("lora_target_modules", "actor.lora.target_modules",
                 _ALL_LINEAR if tm == "all-linear" else list(tm) if isinstance(tm, list) else [tm])


def _trl_reason(key: str) -> str:
    if key.startswith(("vllm_", "use_vllm", "ds3_", "deepspeed", "fsdp", "ddp_", "dataloader_", "torch_compile",
                       "tf32", "fp16", "bf16_full_eval", "half_precision", "local_rank", "tpu", "use_liger")):
        return "launcher/backend setting of transformers/TRL: rlcore generates with its own engine and shards with FSDP2"
    if key.startswith(("report_to", "logging_", "log_", "run_name", "push_to_hub", "hub_", "wandb")):
        return "logging/hub setting: rlcore logs through plugins (docs/observability.md)"
    if key in ("reward_weights", "reward_funcs"):
        return "rewards are set in the rlcore config's reward section (reward.weights, custom_reward_function)"
    if key.startswith("dataset"):
        return "rlcore reads prompts from files: set data.train_files (parquet/jsonl)"
    return "no rlcore counterpart"


def convert(source: str, path: str, overrides: Optional[list[str]] = None) -> Conversion:
    """Read ``path`` and convert it from ``source`` (``verl`` or ``trl``)."""
    if source not in SOURCES:
        raise ConfigError([f"convert-config: --from must be one of {', '.join(SOURCES)}, got {source!r}"])
    data = read_source(path)
    try:
        return convert_verl(data, overrides) if source == "verl" else convert_trl(data, overrides)
    except ConfigError:
        raise
    except (ValueError, TypeError, AttributeError) as e:  # a value of a type no config of the source has
        raise ConfigError([f"convert-config: {path}: a value of an unexpected type or form ({type(e).__name__}: "
                           f"{e}); check the file and the overrides against the source's own config"]) from None
