"""Load, merge and validate configuration: YAML files, dotlist overrides, struct mode.

All problems found are reported together in one :class:`ConfigError`, each naming the dotted key
and, for unknown keys, the nearest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import typing
from typing import Any, Iterable, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlcore.config.schema import GROUP_ESTIMATORS, Choice, RLCoreConfig, trains_critic
from rlcore.errors import ConfigError

# Dict-typed fields whose keys are free-form (not checked against the schema).
_FREE_FORM = {"kwargs", "plugin_config", "weights", "rank_groups", "lr_scheduler_kwargs"}


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


def _choice_keys(cls: type, prefix: str = "") -> dict[str, type[Choice]]:
    """Dotted keys typed with a :class:`~rlcore.config.schema.Choice` enum (or an optional one) -> the enum."""
    out: dict[str, type[Choice]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) is typing.Union and len(args) == 1:
            kind = args[0]
        if dataclasses.is_dataclass(kind):
            out.update(_choice_keys(kind, f"{prefix}{f.name}."))
        elif isinstance(kind, type) and issubclass(kind, Choice):
            out[f"{prefix}{f.name}"] = kind
    return out


#: Module names of token embeddings and output heads across model families, refused in
#: ``actor.lora.target_modules`` (such adapters are neither merged on export nor seen by the rollout
#: engine); :func:`rlcore.trainer.lora.add_adapters` refuses any other name that reaches them too.
LORA_REFUSED_TARGETS = frozenset({"embed_tokens", "lm_head", "wte", "wpe", "embed_in", "embed_out",
                                  "word_embeddings", "embeddings", "tok_embeddings", "output"})

#: Keys with a fixed set of allowed values (``key -> enum``): the one place the config checks and
#: the reference page take them from.
CHOICE_KEYS = _choice_keys(RLCoreConfig)


def _member(kind: type[Choice], value: Any) -> Choice | None:
    """The member of ``kind`` whose value (or name) is ``value``; ``None`` if there is none."""
    if isinstance(value, kind):
        return value
    for member in kind:
        if value in (member.value, member.name):
            return member
    return None


def to_container(cfg: DictConfig) -> dict:
    """The config as plain Python data (allowed values as their strings), for YAML, JSON and plugins."""
    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, list):
            return [plain(v) for v in value]
        return value.value if isinstance(value, enum.Enum) else value

    return plain(OmegaConf.to_container(cfg, resolve=True))


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


def _apply(base: DictConfig, source: dict, origin: str, errors: list[str], refused: dict[str, str]) -> None:
    """Merge ``source`` into ``base``; a value outside a key's allowed set goes to ``refused``
    (``key -> message``), reported by :func:`_check_values` once it is known whether the key is read."""
    for key, value in _flatten(source):
        if not key:
            continue
        msg = _unknown(key)
        if msg:
            errors.append(f"{origin}: {msg}")
            continue
        if key in LIST_KEYS and isinstance(value, str):
            value = [value]
        if key in CHOICE_KEYS and value is not None:
            member = _member(CHOICE_KEYS[key], value)
            if member is None:
                refused[key] = (f"{origin}: '{key}' = {value!r} is not one of "
                                + ", ".join(CHOICE_KEYS[key].values()))
                continue
            refused.pop(key, None)
            value = member
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


def _check_values(cfg: DictConfig, errors: list[str], refused: dict[str, str] | None = None) -> None:
    # Without a critic (GRPO, RLOO) its settings are never read, so they are not held against the run.
    no_critic = not trains_critic(cfg.algorithm.adv_estimator)
    errors.extend(msg for key, msg in (refused or {}).items() if not (no_critic and key.startswith("critic.")))
    for role in ("actor",) if no_critic else ("actor", "critic"):
        scheduler = cfg[role].lr_scheduler
        problem = lr_scheduler_problem(scheduler, OmegaConf.to_container(cfg[role].lr_scheduler_kwargs))
        if problem:
            errors.append(f"'{role}.lr_scheduler' = {scheduler!r}: {problem}")
        if not cfg[role].lr > 0:
            errors.append(f"'{role}.lr' must be > 0, got {cfg[role].lr}")
        for key in ("warmup_steps", "grad_clip", "weight_decay"):
            if cfg[role][key] < 0:
                errors.append(f"'{role}.{key}' must be >= 0, got {cfg[role][key]}")
    from rlcore.trainer.sdpa import problem as sdpa_problem

    bad = sdpa_problem(cfg.trainer.sdpa_backends)
    if bad:
        errors.append(f"'trainer.sdpa_backends' {bad}")
    rbs = cfg.ppo.rollout_batch_size
    if not (rbs == "auto" or (isinstance(rbs, int) and not isinstance(rbs, bool) and rbs > 0)):
        errors.append(f"'ppo.rollout_batch_size' = {rbs!r} must be a positive integer or 'auto'")
    for key in ("env.max_turns", "env.max_concurrency", "env.max_observation_chars"):
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
                "ppo.mini_batch_size", "ppo.micro_batch_size", "ppo.kl_coeff", "trainer.profile_steps",
                "ppo.max_tokens_per_micro_batch"]:
        if OmegaConf.select(cfg, key) < 0:
            errors.append(f"'{key}' must be >= 0, got {OmegaConf.select(cfg, key)}")
    _check_ranges(cfg, errors)
    if not 0.0 < cfg.ppo.generation.top_p <= 1.0:
        errors.append(f"'ppo.generation.top_p' must be in (0, 1], got {cfg.ppo.generation.top_p}")
    for key in ("ppo.pack_sequences", "actor.gradient_checkpointing", "critic.gradient_checkpointing"):
        v = OmegaConf.select(cfg, key)
        if not (isinstance(v, bool) or v == "auto"):
            errors.append(f"'{key}' = {v!r} must be true, false or auto")
    if not cfg.ppo.rollout_is_cap > 0:
        errors.append(f"'ppo.rollout_is_cap' must be > 0, got {cfg.ppo.rollout_is_cap}")
    if cfg.ppo.generation.temperature < 0:
        errors.append("'ppo.generation.temperature' must be >= 0")
    if cfg.ppo.generation.top_k < 0:
        errors.append(f"'ppo.generation.top_k' must be >= 0 (0 = off), got {cfg.ppo.generation.top_k}")
    if cfg.algorithm.adv_estimator in GROUP_ESTIMATORS and cfg.ppo.generation.n < 2:
        errors.append(f"'algorithm.adv_estimator' = {cfg.algorithm.adv_estimator} needs "
                      f"'ppo.generation.n' >= 2 samples per prompt, got {cfg.ppo.generation.n}")
    _check_recipes(cfg, errors)
    errors.extend(partial_rollout_problems(cfg))
    rm = cfg.actor.remeshing
    for key in ("generation_shard_size", "training_shard_size"):
        if rm[key] < 1:
            errors.append(f"'actor.remeshing.{key}' must be >= 1, got {rm[key]}")
    errors.extend(_engine_problems(cfg.actor.rollout_engine))
    if cfg.custom_reward_function.path is not None and not cfg.custom_reward_function.name:
        errors.append("'custom_reward_function.name' is required with 'custom_reward_function.path'")
    if (cfg.data.custom_cls.path is None) != (cfg.data.custom_cls.name is None):
        errors.append("'data.custom_cls.path' and 'data.custom_cls.name' must be given together")


def lr_scheduler_problem(name: str, kwargs: dict) -> str | None:
    """Why ``name`` with ``kwargs`` (``lr_scheduler_kwargs``) cannot be a role's schedule, ``None`` when it
    can: the schedule is built once on a stand-in optimizer, so unknown names and missing or unknown
    keyword arguments show before any model loads."""
    import torch
    from transformers import SchedulerType

    from rlcore.trainer.models import METRIC_SCHEDULES, build_scheduler

    names = [s.value for s in SchedulerType if s.value not in METRIC_SCHEDULES]
    if name not in names and name not in METRIC_SCHEDULES:
        near = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
        return f"not a schedule of transformers.get_scheduler ({', '.join(names)})" + (
            f"; did you mean '{near[0]}'?" if near else "")
    try:
        build_scheduler(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), name, 1, 10, kwargs)
    except (TypeError, ValueError) as error:
        return f"{error} (schedule arguments go in lr_scheduler_kwargs)"
    return None


def _engine_problems(engine: DictConfig) -> list[str]:
    """Values of ``actor.rollout_engine`` its types allow but the engine cannot use, each naming its key."""
    from rlcore.kernels import decode_attention
    from rlcore.rollout.engine import decode
    from rlcore.rollout.engine.core import check_page_size

    problems = []

    def bad(key: str, message: str) -> None:
        problems.append(f"'actor.rollout_engine.{key}': {message}")

    for key in ("eos_check_interval", "max_prefill_tokens"):
        if engine[key] < 1:
            bad(key, f"must be >= 1, got {engine[key]}")
    if engine.attention_length_step is not None and engine.attention_length_step < 1:
        bad("attention_length_step", f"must be >= 1 or null, got {engine.attention_length_step}")
    if not 0.0 < engine.admit_fraction <= 1.0:
        bad("admit_fraction", f"must be in (0, 1], got {engine.admit_fraction}")
    if not 0.0 < engine.kv_memory_fraction <= 1.0:
        bad("kv_memory_fraction", f"must be in (0, 1], got {engine.kv_memory_fraction}")
    if engine.kv_pages is not None and engine.kv_pages < 2:
        bad("kv_pages", f"must be >= 2 or null, got {engine.kv_pages}")
    try:
        check_page_size(engine.page_size)
    except ValueError as error:
        bad("page_size", str(error).removeprefix("RolloutEngine: "))
    else:
        block = engine.attention_tuning.block_n or max(decode_attention.BLOCK_N, decode_attention.BLOCK_N_WIDE)
        if str(engine.kv_cache) == "paged" and str(engine.attention) != "sdpa" and engine.page_size % block:
            bad("page_size", f"{engine.page_size} is not a multiple of the Triton attention kernel's block of {block} "
                             f"columns (attention={engine.attention}; attention_tuning.block_n sets the block); "
                             "smaller pages need attention=sdpa")
    if not engine.graph_batch_buckets or any(b < 1 for b in engine.graph_batch_buckets):
        bad("graph_batch_buckets", f"must be batch sizes >= 1, got {list(engine.graph_batch_buckets)}")
    for key, check in (("split_k", decode.split_k_tuple), ("split_k_few_rows", decode.split_k_tuple),
                       ("attention_tuning", decode.check_attention_tuning)):
        given = {k: v for k, v in OmegaConf.to_container(engine[key]).items() if v is not None}
        try:
            check(given)
        except ValueError as error:
            bad(key, str(error))
    return problems


def _check_ranges(cfg: DictConfig, errors: list[str]) -> None:
    """Numeric ranges of the RL settings, so a bad value fails at load time, not after a model loads
    and a rollout ran; and the mini-batch size against the rollout it cuts."""
    ppo, algo = cfg.ppo, cfg.algorithm

    def need(ok: bool, key: str, what: str, value: Any) -> None:
        if not ok:
            errors.append(f"'{key}' must be {what}, got {value}")

    need(ppo.cliprange >= 0, "ppo.cliprange", ">= 0 (the ratio clip distance, e.g. 0.2)", ppo.cliprange)
    if ppo.cliprange_high is not None:
        need(ppo.cliprange_high >= 0, "ppo.cliprange_high", ">= 0 or null", ppo.cliprange_high)
    if ppo.dual_clip is not None:
        need(ppo.dual_clip > 1, "ppo.dual_clip", "> 1 (e.g. 3.0) or null to turn it off", ppo.dual_clip)
    need(ppo.cliprange_value >= 0, "ppo.cliprange_value", ">= 0", ppo.cliprange_value)
    need(ppo.vf_coef >= 0, "ppo.vf_coef", ">= 0", ppo.vf_coef)
    need(ppo.entropy_coeff >= 0, "ppo.entropy_coeff", ">= 0 (a bonus weight)", ppo.entropy_coeff)
    need(ppo.kl_target > 0, "ppo.kl_target", "> 0", ppo.kl_target)
    need(ppo.kl_horizon >= 1, "ppo.kl_horizon", ">= 1", ppo.kl_horizon)
    need(0.0 <= algo.gamma <= 1.0, "algorithm.gamma", "in [0, 1] (the discount)", algo.gamma)
    need(0.0 <= algo.lam <= 1.0, "algorithm.lam", "in [0, 1] (the GAE lambda)", algo.lam)
    need(cfg.trainer.eval_samples >= 0, "trainer.eval_samples", ">= 0 (0 = no evaluation)", cfg.trainer.eval_samples)
    for role in ("actor", "critic"):
        betas = list(cfg[role].betas)
        need(len(betas) == 2 and all(0.0 <= float(b) < 1.0 for b in betas), f"{role}.betas",
             "two numbers in [0, 1) (AdamW's beta1, beta2)", betas)
        need(cfg[role].eps > 0, f"{role}.eps", "> 0", cfg[role].eps)
    ev = cfg.eval
    need(ev.n >= 1, "eval.n", ">= 1 (samples per prompt)", ev.n)
    need(ev.temperature >= 0, "eval.temperature", ">= 0 (0 = greedy)", ev.temperature)
    need(0.0 < ev.top_p <= 1.0, "eval.top_p", "in (0, 1]", ev.top_p)
    need(ev.top_k >= 0, "eval.top_k", ">= 0 (0 = off)", ev.top_k)
    if ev.max_new_tokens is not None:
        need(ev.max_new_tokens >= 1, "eval.max_new_tokens", ">= 1 or null", ev.max_new_tokens)
    if ev.max_prompts is not None:
        need(ev.max_prompts >= 0, "eval.max_prompts", ">= 0 (0 = every row) or null", ev.max_prompts)
    need(cfg.trainer.max_nonfinite_steps >= 0, "trainer.max_nonfinite_steps", ">= 0", cfg.trainer.max_nonfinite_steps)
    rw = cfg.reward
    need(rw.num_workers >= 0, "reward.num_workers", ">= 0", rw.num_workers)
    need(rw.timeout_s > 0, "reward.timeout_s", "> 0 seconds", rw.timeout_s)
    need(0.0 <= rw.max_fallback_share <= 1.0, "reward.max_fallback_share", "in [0, 1]", rw.max_fallback_share)
    rbs, mini = ppo.rollout_batch_size, ppo.mini_batch_size
    if isinstance(rbs, int) and not isinstance(rbs, bool) and rbs > 0 and mini > 0 and ppo.generation.n > 0:
        problem = mini_batch_problem(rbs * ppo.generation.n, mini)
        if problem:
            errors.append(f"'ppo.mini_batch_size' = {mini}: {problem} (ppo.rollout_batch_size={rbs} prompts x "
                          f"ppo.generation.n={ppo.generation.n})")


def mini_batch_problem(samples: int, mini: int) -> str | None:
    """Why ``mini`` samples per optimizer step cannot cut a rollout of ``samples`` (None: they can)."""
    if mini <= 0 or mini >= samples or samples % mini == 0:
        return None
    lower = max(d for d in range(1, mini + 1) if samples % d == 0)
    return (f"does not divide the {samples} samples of a rollout, so {samples % mini} samples per epoch would "
            f"never be trained on; use a divisor of {samples} (e.g. {lower}) or 0 for the whole rollout")


def config_warnings(cfg: DictConfig) -> list[str]:
    """Settings that are valid but almost certainly not what the user wants (logged, not raised)."""
    out = []
    est, gen = cfg.algorithm.adv_estimator, cfg.ppo.generation
    if est in GROUP_ESTIMATORS and gen.temperature == 0 and gen.n > 1:
        out.append(f"ppo.generation.temperature=0 with algorithm.adv_estimator={est}: the {gen.n} samples of a "
                   "prompt are the same greedy response, so every group advantage is zero and nothing is learned; "
                   "sample with a temperature > 0 (e.g. 1.0)")
    return out


def _check_recipes(cfg: DictConfig, errors: list[str]) -> None:
    """Policy-loss, DAPO and LoRA settings (docs/recipes.md)."""
    ppo, algo, lora = cfg.ppo, cfg.algorithm, cfg.actor.lora
    if ppo.dual_clip is not None and ppo.policy_loss != "vanilla":
        errors.append(f"'ppo.dual_clip' applies to 'ppo.policy_loss' = vanilla only, not '{ppo.policy_loss}' "
                      "(set ppo.dual_clip=null)")
    ds = algo.dynamic_sampling
    if ds.enable:
        if algo.adv_estimator not in GROUP_ESTIMATORS:
            errors.append(f"'algorithm.dynamic_sampling.enable' drops groups of equal rewards, which needs a group "
                          f"estimator ({', '.join(GROUP_ESTIMATORS)}), not 'algorithm.adv_estimator' = "
                          f"'{algo.adv_estimator}'")
        if ds.max_rounds < 0:
            errors.append(f"'algorithm.dynamic_sampling.max_rounds' must be >= 0, got {ds.max_rounds}")
    ob = algo.overlong_buffer
    if ob.length < 0:
        errors.append(f"'algorithm.overlong_buffer.length' must be >= 0 (0 = off), got {ob.length}")
    elif ob.length > cfg.ppo.generation.max_new_tokens:
        errors.append(f"'algorithm.overlong_buffer.length' = {ob.length} exceeds 'ppo.generation.max_new_tokens' = "
                      f"{cfg.ppo.generation.max_new_tokens}")
    if ob.penalty_factor < 0:
        errors.append(f"'algorithm.overlong_buffer.penalty_factor' must be >= 0, got {ob.penalty_factor}")
    if lora.rank < 0:
        errors.append(f"'actor.lora.rank' must be >= 0 (0 = no adapters), got {lora.rank}")
    elif lora.rank > 0:
        if not lora.alpha > 0:
            errors.append(f"'actor.lora.alpha' must be > 0, got {lora.alpha}")
        if not 0.0 <= lora.dropout < 1.0:
            errors.append(f"'actor.lora.dropout' must be in [0, 1), got {lora.dropout}")
        if not lora.target_modules:
            errors.append("'actor.lora.target_modules' is empty: name the linear layers that get adapters, "
                          "e.g. [q_proj, v_proj]")
        refused = [str(m) for m in lora.target_modules if str(m).rsplit(".", 1)[-1] in LORA_REFUSED_TARGETS]
        if refused:
            errors.append(f"'actor.lora.target_modules' names {', '.join(refused)}: adapters on the token "
                          "embeddings or the output head are not supported (they would be left out of the "
                          "exported final/ and of the rollout engine's weights); target the decoder's linear "
                          "layers, e.g. [q_proj, v_proj]")
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            errors.append(f"'actor.lora.rank' = {lora.rank} needs the peft package, which is not installed: "
                          "pip install 'rlcore[lora]' (or set actor.lora.rank=0 for full fine-tuning)")


def partial_rollout_key(partial) -> str:
    """The ``ppo.partial_rollout`` key an error about partial rollouts names: ``segment`` when set, else
    ``tail_rows``."""
    return "segment" if int(partial.segment) > 0 else "tail_rows"


def partial_rollout_problems(cfg: DictConfig, world_size: int | None = None) -> list[str]:
    """What the rest of the config (and, given, the job's ``world_size``) must be for partial rollouts
    (``ppo.partial_rollout.segment > 0`` or ``ppo.partial_rollout.tail_rows > 0``), each problem naming the
    partial-rollout key that is set and the conflicting key."""
    partial = cfg.ppo.partial_rollout
    bad = [f"'ppo.partial_rollout.{name}' must be >= 0 (0 = off), got {partial[name]}"
           for name in ("segment", "tail_rows") if partial.get(name, 0) < 0]
    if bad:
        return bad
    name = partial_rollout_key(partial)
    value = partial.get(name, 0)
    if value == 0:
        return []
    key = f"'ppo.partial_rollout.{name}'"
    head = f"{key} = {value} (partial rollouts)"
    algo, ppo = cfg.algorithm, cfg.ppo
    problems = []
    if str(ppo.rollout_is) == "none":
        problems.append(f"{head} trains carried samples whose first tokens came from older policies: set "
                        "'ppo.rollout_is' to token or sequence (the clipped importance weight that corrects for it), "
                        f"or ppo.partial_rollout.{name} to 0")
    if cfg.data.env_key:
        problems.append(f"{head} does not carry multi-turn episodes ('data.env_key' = {cfg.data.env_key!r}): unset "
                        f"data.env_key or set ppo.partial_rollout.{name}=0")
    if algo.dynamic_sampling.enable:
        problems.append(f"{head} does not run with 'algorithm.dynamic_sampling.enable' (its extra rounds refill a "
                        "batch whose groups finish at different steps): turn one of them off")
    if ppo.overlap_update:
        problems.append(f"{head} does not run with 'ppo.overlap_update' (the groups a step trains are known only "
                        "after its rollout): turn one of them off")
    if str(algo.adv_estimator) == "remax":
        problems.append(f"{head} does not run 'algorithm.adv_estimator' = remax (its greedy baseline is generated "
                        "with the step's prompts, not with the groups that finish); use grpo, rloo or gae")
    nproc = int(cfg.trainer.nproc_per_node)
    if nproc > 1:
        problems.append(f"{head} runs in one process only, not 'trainer.nproc_per_node' = {nproc}: set "
                        f"trainer.nproc_per_node=1 or ppo.partial_rollout.{name}=0")
    elif world_size is not None and world_size > 1:
        problems.append(f"{head} runs in one process only, not in a job of {world_size} processes (the world size "
                        "of the launcher, e.g. torchrun --nproc_per_node): start one process or set "
                        f"ppo.partial_rollout.{name}=0")
    return problems


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
    refused: dict[str, str] = {}
    for path in config_files:
        try:
            data = read_yaml(path)
        except ConfigError as e:
            errors.extend(e.problems)
            continue
        _apply(cfg, data, path, errors, refused)
    tree, parse_errors = parse_overrides(overrides)
    errors.extend(parse_errors)
    _apply(cfg, tree, "override", errors, refused)
    _check_values(cfg, errors, refused)  # keys that failed to apply keep valid defaults, so this is safe
    if errors:
        raise ConfigError(errors)
    OmegaConf.set_struct(cfg, True)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.create(to_container(cfg)))


def section(cfg: DictConfig, name: str):
    """Return the typed dataclass object of one top-level section (what a component receives)."""
    return OmegaConf.to_object(cfg[name])
