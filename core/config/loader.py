"""Load, merge and validate configuration: YAML files, dotlist overrides, struct mode.

All problems found are reported together in one :class:`ConfigError`, each naming the dotted key
and, for unknown keys, the nearest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any, Iterable, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlcore.config.schema import RLCoreConfig, trains_critic
from rlcore.errors import ConfigError

# Dict-typed fields whose keys are free-form (not checked against the schema).
_FREE_FORM = {"kwargs", "plugin_config", "weights", "rank_groups", "rollout_engine"}

CHOICES: dict[str, tuple[str, ...]] = {
    "algorithm.adv_estimator": ("gae", "grpo", "rloo"),
    "ppo.kl_estimator": ("k1", "k2", "mse", "k3", "low_var_kl", "abs"),
    "ppo.kl_ctrl": ("fixed", "adaptive"),
    "ppo.loss_agg": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
    "data.truncation": ("error", "left", "right"),
    "fsdp.sharding_strategy": ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"),
    "fsdp.param_dtype": ("bf16", "fp16", "fp32"),
    "fsdp.reduce_dtype": ("bf16", "fp32"),
    "actor.dtype": ("fp32", "bf16"),
    "critic.dtype": ("fp32", "bf16"),
    "actor.lr_scheduler": ("constant", "cosine", "linear"),
    "critic.lr_scheduler": ("constant", "cosine", "linear"),
    "actor.rollout_backend": ("auto", "engine", "hf"),
    "reward_model.dtype": ("fp32", "bf16", "fp16"),
}


def _schema_keys(cls: type, prefix: str = "") -> dict[str, bool]:
    """Map every dotted key of the schema to whether it is a free-form dict."""
    out: dict[str, bool] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out[key] = False
            out.update(_schema_keys(type(default), key + "."))
        else:
            out[key] = f.name in _FREE_FORM
    return out


SCHEMA_KEYS = _schema_keys(RLCoreConfig)


def _list_keys(cls: type, prefix: str = "") -> set[str]:
    """Dotted keys typed as lists: a single string given for them is taken as a one-item list."""
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            out |= _list_keys(type(default), f"{prefix}{f.name}.")
        elif str(f.type).startswith("list"):
            out.add(f"{prefix}{f.name}")
    return out


LIST_KEYS = _list_keys(RLCoreConfig)


def _flatten(d: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(d, dict) and d and not (prefix.rstrip(".") and SCHEMA_KEYS.get(prefix.rstrip("."))):
        for k, v in d.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), d


def suggest(key: str) -> str | None:
    """The nearest valid dotted key to ``key``, if any is close.

    Tried in order: the same leaf name in another section (``trainer.kl_coeff`` -> ``ppo.kl_coeff``),
    a similar leaf in the same section (``data.trian_files`` -> ``data.train_files``), any similar key.
    """
    parent, _, leaf = key.rpartition(".")
    same_leaf = [k for k in SCHEMA_KEYS if k.rpartition(".")[2] == leaf]
    if same_leaf:
        return same_leaf[0]
    siblings = {k.rpartition(".")[2]: k for k in SCHEMA_KEYS if k.rpartition(".")[0] == parent}
    match = difflib.get_close_matches(leaf, list(siblings), n=1, cutoff=0.6)
    if match:
        return siblings[match[0]]
    match = difflib.get_close_matches(key, list(SCHEMA_KEYS), n=1, cutoff=0.75)
    return match[0] if match else None


def _unknown(key: str) -> str | None:
    """Return an error message if ``key`` is not in the schema (free-form subtrees allowed)."""
    if key in SCHEMA_KEYS:
        return None
    parts = key.split(".")
    for i in range(1, len(parts)):
        head = ".".join(parts[:i])
        if SCHEMA_KEYS.get(head):
            return None
        if head not in SCHEMA_KEYS:
            break
    hint = suggest(key)
    return f"unknown key '{key}'" + (f" (did you mean '{hint}'?)" if hint else "")


def read_yaml(path: str) -> dict:
    if not os.path.exists(path):
        raise ConfigError([f"config file not found: {path}"])
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except yaml.YAMLError as e:
        raise ConfigError([f"{path}: not valid YAML: {e}"]) from e
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a mapping, got {type(data).__name__}"])
    return data


def parse_overrides(overrides: Sequence[str]) -> tuple[dict, list[str]]:
    errors = []
    good = []
    for o in overrides:
        if "=" not in o or o.startswith("="):
            hint = f" (a config file? pass it as --config {o})" if o.endswith((".yaml", ".yml")) else ""
            errors.append(f"override '{o}' is not of the form key=value{hint}")
        else:
            good.append(o)
    try:
        tree = OmegaConf.to_container(OmegaConf.from_dotlist(good)) if good else {}
    except OmegaConfBaseException as e:
        errors.append(f"cannot parse overrides {good}: {e}")
        tree = {}
    return tree, errors


def _rank_group_problems(value: Any) -> list[str]:
    """Problems of a ``placement.rank_groups`` value (role -> list of ranks) that need no world size."""
    from rlcore.protocols import ROLES

    if not isinstance(value, dict):
        return [f"'placement.rank_groups' must map a role to a list of ranks, e.g. {{reward: [0]}}; got {value!r}"]
    problems = []
    for role, ranks in value.items():
        key = f"placement.rank_groups.{role}"
        if role not in ROLES:
            near = difflib.get_close_matches(str(role), ROLES, n=1, cutoff=0.6)
            problems.append(f"'{key}': unknown role '{role}' (roles: {', '.join(ROLES)})"
                            + (f"; did you mean '{near[0]}'?" if near else ""))
        elif not isinstance(ranks, (list, tuple)):
            problems.append(f"'{key}' must be a list of global ranks, e.g. [0]; got {ranks!r}")
        elif not ranks:
            problems.append(f"'{key}' is empty (leave the role out to keep it on every rank)")
        else:
            bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or r < 0]
            if bad:
                problems.append(f"'{key}': ranks must be integers >= 0, got {bad}")
            elif len(set(ranks)) != len(ranks):
                problems.append(f"'{key}': {list(ranks)} repeats a rank")
    return problems


#: Checks run on a key's raw value before it is merged (their messages name the exact key).
_PRECHECKS = {"placement.rank_groups": _rank_group_problems}


def _apply(base: DictConfig, source: dict, origin: str, errors: list[str]) -> None:
    for key, value in _flatten(source):
        if not key:
            continue
        msg = _unknown(key)
        if msg:
            errors.append(f"{origin}: {msg}")
            continue
        if key in LIST_KEYS and isinstance(value, str):
            value = [value]
        if key in _PRECHECKS:
            problems = _PRECHECKS[key](value)
            if problems:
                errors.extend(f"{origin}: {p}" for p in problems)
                continue
        try:
            OmegaConf.update(base, key, value, merge=True, force_add=SCHEMA_KEYS.get(key, True))
        except OmegaConfBaseException as e:
            detail = str(e).splitlines()[0]
            errors.append(f"{origin}: bad value for '{key}': {value!r} ({detail})")


def _check_values(cfg: DictConfig, errors: list[str]) -> None:
    # Without a critic (GRPO, RLOO) its settings are never read, so they are not held against the run.
    no_critic = not trains_critic(cfg.algorithm.adv_estimator)
    for key, allowed in CHOICES.items():
        if no_critic and key.startswith("critic."):
            continue
        value = OmegaConf.select(cfg, key)
        if value is not None and value not in allowed:
            errors.append(f"'{key}' = {value!r} is not one of {', '.join(allowed)}")
    for role in ("actor",) if no_critic else ("actor", "critic"):
        for name in ("sharding_strategy", "param_dtype", "reduce_dtype"):  # per-role refinements of ``fsdp``
            v = OmegaConf.select(cfg, f"{role}.fsdp.{name}")
            if v is not None and v not in CHOICES[f"fsdp.{name}"]:
                errors.append(f"'{role}.fsdp.{name}' = {v!r} is not one of " + ", ".join(CHOICES[f"fsdp.{name}"]))
        if not cfg[role].lr > 0:
            errors.append(f"'{role}.lr' must be > 0, got {cfg[role].lr}")
        for key in ("warmup_steps", "grad_clip", "weight_decay"):
            if cfg[role][key] < 0:
                errors.append(f"'{role}.{key}' must be >= 0, got {cfg[role][key]}")
    rbs = cfg.ppo.rollout_batch_size
    if not (rbs == "auto" or (isinstance(rbs, int) and not isinstance(rbs, bool) and rbs > 0)):
        errors.append(f"'ppo.rollout_batch_size' = {rbs!r} must be a positive integer or 'auto'")
    for key in ("env.max_turns", "env.max_concurrency"):
        if OmegaConf.select(cfg, key) < 1:
            errors.append(f"'{key}' must be >= 1, got {OmegaConf.select(cfg, key)}")
    if cfg.env.max_tokens is not None and cfg.env.max_tokens < 2:
        errors.append(f"'env.max_tokens' must be >= 2 (a turn and one observation token) or null, got {cfg.env.max_tokens}")
    if not cfg.env.timeout_s > 0:
        errors.append(f"'env.timeout_s' must be > 0, got {cfg.env.timeout_s}")
    positive = ["ppo.generation.batch_size", "ppo.generation.max_new_tokens", "ppo.generation.n",
                "ppo.ppo_epochs", "trainer.gradient_accumulation_steps", "trainer.log_steps",
                "data.max_prompt_length", "trainer.nproc_per_node", "data.prefetch_factor"]
    for key in positive:
        if OmegaConf.select(cfg, key) < 1:
            errors.append(f"'{key}' must be >= 1, got {OmegaConf.select(cfg, key)}")
    for key in ["trainer.max_steps", "trainer.save_steps", "trainer.eval_steps", "data.num_workers",
                "ppo.mini_batch_size", "ppo.micro_batch_size", "ppo.kl_coeff", "trainer.profile_steps"]:
        if OmegaConf.select(cfg, key) < 0:
            errors.append(f"'{key}' must be >= 0, got {OmegaConf.select(cfg, key)}")
    if not 0.0 < cfg.ppo.generation.top_p <= 1.0:
        errors.append(f"'ppo.generation.top_p' must be in (0, 1], got {cfg.ppo.generation.top_p}")
    if cfg.ppo.generation.temperature < 0:
        errors.append("'ppo.generation.temperature' must be >= 0")
    if cfg.ppo.generation.top_k < 0:
        errors.append(f"'ppo.generation.top_k' must be >= 0 (0 = off), got {cfg.ppo.generation.top_k}")
    if cfg.algorithm.adv_estimator in ("grpo", "rloo") and cfg.ppo.generation.n < 2:
        errors.append(f"'algorithm.adv_estimator' = {cfg.algorithm.adv_estimator} needs "
                      f"'ppo.generation.n' >= 2 samples per prompt, got {cfg.ppo.generation.n}")
    rm = cfg.actor.remeshing
    for key in ("generation_shard_size", "training_shard_size"):
        if rm[key] < 1:
            errors.append(f"'actor.remeshing.{key}' must be >= 1, got {rm[key]}")
    engine = OmegaConf.to_container(cfg.actor.rollout_engine)
    if engine:
        from rlcore.rollout.engine import check_config_settings

        errors.extend(f"'actor.rollout_engine.{key}': {problem}" for key, problem in check_config_settings(engine))
    if cfg.custom_reward_function.path is not None and not cfg.custom_reward_function.name:
        errors.append("'custom_reward_function.name' is required with 'custom_reward_function.path'")
    if (cfg.data.custom_cls.path is None) != (cfg.data.custom_cls.name is None):
        errors.append("'data.custom_cls.path' and 'data.custom_cls.name' must be given together")


def check_config(cfg: DictConfig) -> None:
    """The value checks of :func:`load_config` again, for a config changed after loading (the Python API).

    :raises ConfigError: listing every bad value.
    """
    errors: list[str] = []
    _check_values(cfg, errors)
    if errors:
        raise ConfigError(errors)


def load_config(config_files: Sequence[str] = (), overrides: Sequence[str] = ()) -> DictConfig:
    """Build the resolved config from YAML files (applied in order) and ``key=value`` overrides.

    :raises ConfigError: listing every problem found (unknown keys with suggestions, bad values).
    """
    cfg = OmegaConf.structured(RLCoreConfig)
    errors: list[str] = []
    for path in config_files:
        try:
            data = read_yaml(path)
        except ConfigError as e:
            errors.extend(e.problems)
            continue
        _apply(cfg, data, path, errors)
    tree, parse_errors = parse_overrides(overrides)
    errors.extend(parse_errors)
    _apply(cfg, tree, "override", errors)
    _check_values(cfg, errors)  # keys that failed to apply keep valid defaults, so this is safe
    if errors:
        raise ConfigError(errors)
    OmegaConf.set_struct(cfg, True)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)


def section(cfg: DictConfig, name: str):
    """Return the typed dataclass object of one top-level section (what a component receives)."""
    return OmegaConf.to_object(cfg[name])
