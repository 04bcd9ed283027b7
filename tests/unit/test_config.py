"""Typed config: YAML + overrides, struct mode with suggestions, all errors at once, seed keys accepted."""

import pytest
from omegaconf import OmegaConf

from rlcore.config import SCHEMA_KEYS, load_config, suggest
from rlcore.config.inert import inert_keys
from rlcore.config.schema import FSDPConfig, RoleFSDPConfig, resolve_fsdp
from rlcore.errors import ConfigError

SEED_KEYS = [
    "data.train_files", "data.val_files", "data.cache_dir", "data.num_workers", "data.prefetch_factor",
    "data.filter_overlong_prompts", "data.max_prompt_length", "data.custom_cls.path", "data.custom_cls.name",
    "actor.remeshing.enabled", "actor.remeshing.generation_shard_size", "actor.remeshing.training_shard_size",
    "actor.fsdp.use_orig_params", "actor.fsdp.sharding_strategy", "actor.fsdp.cpu_offload", "actor.device",
    "critic.device", "reward_model.device", "reward_model.dtype", "reward_model.offload",
    "ppo.rollout_batch_size", "ppo.generation.batch_size", "ppo.generation.max_new_tokens",
    "ppo.generation.temperature", "ppo.generation.top_p", "ppo.kl_coeff", "ppo.cliprange_value",
    "trainer.save_steps", "trainer.log_steps", "trainer.enable_profiling", "trainer.profile_steps",
    "trainer.gradient_accumulation_steps", "trainer.max_steps", "trainer.eval_steps",
    "fsdp.sync_module_states", "fsdp.use_orig_params", "fsdp.sharding_strategy", "fsdp.cpu_offload",
]


@pytest.mark.parametrize("key", SEED_KEYS)
def test_every_seed_key_exists(key):
    assert key in SCHEMA_KEYS


def test_yaml_then_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("ppo:\n  kl_coeff: 0.3\n  generation:\n    top_p: 0.9\ntrainer:\n  max_steps: 7\n")
    cfg = load_config([str(f)], ["ppo.kl_coeff=0.05", "data.train_files=[a.parquet,b.parquet]"])
    assert cfg.ppo.kl_coeff == 0.05
    assert cfg.ppo.generation.top_p == 0.9
    assert cfg.trainer.max_steps == 7
    assert list(cfg.data.train_files) == ["a.parquet", "b.parquet"]


def test_single_string_for_a_list_key():
    cfg = load_config([], ["data.val_files=/x/val.parquet"])
    assert list(cfg.data.val_files) == ["/x/val.parquet"]


def test_unknown_key_names_the_nearest_valid_one():
    with pytest.raises(ConfigError) as e:
        load_config([], ["data.trian_files=x"])
    assert "data.trian_files" in str(e.value)
    assert "data.train_files" in str(e.value)


def test_all_errors_are_reported_together(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("actor:\n  remeshing:\n    enabeld: true\n")
    with pytest.raises(ConfigError) as e:
        load_config([str(f)], ["trainer.max_stepz=3", "trainer.max_steps=abc"])
    problems = e.value.problems
    assert len(problems) == 3
    text = str(e.value)
    assert "actor.remeshing.enabled" in text and "trainer.max_steps" in text and str(f) in text


def test_value_checks_name_the_key():
    with pytest.raises(ConfigError) as e:
        load_config([], ["algorithm.adv_estimator=ppo2", "ppo.generation.top_p=1.5"])
    text = str(e.value)
    assert "'algorithm.adv_estimator'" in text and "gae, grpo, rloo" in text
    assert "'ppo.generation.top_p'" in text


def test_optimizer_sampling_and_role_fsdp_values_are_checked_at_load():
    with pytest.raises(ConfigError) as e:
        load_config([], ["actor.lr=-1", "critic.lr=0", "actor.warmup_steps=-5", "actor.grad_clip=-1",
                         "ppo.generation.top_k=-5", "actor.fsdp.param_dtype=bf17", "critic.fsdp.reduce_dtype=fp8"])
    text = str(e.value)
    for part in ("'actor.lr' must be > 0", "'critic.lr' must be > 0", "'actor.warmup_steps' must be >= 0",
                 "'actor.grad_clip' must be >= 0", "'ppo.generation.top_k' must be >= 0",
                 "'actor.fsdp.param_dtype' = 'bf17'", "'critic.fsdp.reduce_dtype' = 'fp8'"):
        assert part in text, part
    cfg = load_config([], ["actor.grad_clip=0", "ppo.generation.top_k=50", "actor.fsdp.param_dtype=fp32"])
    assert cfg.actor.grad_clip == 0 and cfg.ppo.generation.top_k == 50


def test_grpo_needs_several_samples():
    with pytest.raises(ConfigError, match="ppo.generation.n"):
        load_config([], ["algorithm.adv_estimator=grpo", "ppo.generation.n=1"])


def test_rollout_batch_size_accepts_auto_only_as_string():
    assert load_config([], ["ppo.rollout_batch_size=auto"]).ppo.rollout_batch_size == "auto"
    with pytest.raises(ConfigError, match="rollout_batch_size"):
        load_config([], ["ppo.rollout_batch_size=lots"])


def test_missing_and_broken_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config([str(tmp_path / "nope.yaml")])
    bad = tmp_path / "broken.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config([str(bad)])


def test_free_form_sections_accept_any_key():
    cfg = load_config([], ["plugin_config.myplugin.depth=3", "reward.weights.exact_match=1.0"])
    assert cfg.plugin_config.myplugin.depth == 3
    assert cfg.reward.weights.exact_match == 1.0


def test_struct_mode_after_loading():
    cfg = load_config([])
    with pytest.raises(Exception):
        cfg.data.nonexistent = 1


def test_suggest_leaf_typo_in_other_section():
    assert suggest("trainer.kl_coeff") == "ppo.kl_coeff"


def test_role_fsdp_inherits_global():
    merged = resolve_fsdp(FSDPConfig(sharding_strategy="HYBRID_SHARD", cpu_offload=True),
                          RoleFSDPConfig(cpu_offload=False))
    assert merged.sharding_strategy == "HYBRID_SHARD" and merged.cpu_offload is False


def test_inert_keys_are_reported_with_a_reason():
    cfg = load_config([], ["actor.remeshing.enabled=true", "fsdp.sync_module_states=false",
                           "algorithm.adv_estimator=grpo", "ppo.generation.n=2", "critic.lr=0.1"])
    inert = dict(inert_keys(cfg, world_size=1))
    assert "single process" in inert["fsdp.sync_module_states"]
    assert "critic" in inert["critic.lr"]
    assert "actor.remeshing.enabled" not in inert  # a plugin's setting: the plugins report it
    live = dict(inert_keys(cfg, world_size=4))  # with several ranks the same keys are live
    assert "fsdp.sync_module_states" not in live
    cached = load_config([], ["data.cache_dir=/tmp/c"])
    assert "data.cache_dir" not in dict(inert_keys(cached, world_size=1))
    custom = load_config([], ["data.cache_dir=/tmp/c", "data.custom_cls.path=x.py", "data.custom_cls.name=X"])
    assert "custom_cls" in dict(inert_keys(custom, world_size=1))["data.cache_dir"]


def test_recomputing_pointwise_results_without_compiled_layers_is_reported():
    off = load_config([], ["actor.compile=false", "actor.compile_recompute_pointwise=false"])
    assert dict(inert_keys(off, world_size=1))["actor.compile_recompute_pointwise"] == "actor.compile is false"
    on = load_config([], ["actor.compile_recompute_pointwise=false"])  # compiled by default on CUDA
    assert "actor.compile_recompute_pointwise" not in dict(inert_keys(on, world_size=1))
    # the default (on) is not a key the user set: nothing to report without compiled layers either
    default = load_config([], ["actor.compile=false"])
    assert "actor.compile_recompute_pointwise" not in dict(inert_keys(default, world_size=1))


def test_compiled_layers_recompute_pointwise_results_by_default():
    cfg = load_config([], [])
    assert cfg.actor.compile_recompute_pointwise is True and cfg.critic.compile_recompute_pointwise is True


def test_config_is_plain_yaml_round_trip():
    cfg = load_config([], ["ppo.kl_coeff=0.2"])
    again = OmegaConf.create(OmegaConf.to_yaml(cfg))
    assert again.ppo.kl_coeff == 0.2


def test_values_changed_after_loading_are_checked_again():
    from rlcore.config import check_config

    cfg = load_config([], [])
    check_config(cfg)
    cfg.ppo.rollout_batch_size = -5
    cfg.actor.lr = 0.0
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert "'ppo.rollout_batch_size'" in str(e.value) and "'actor.lr' must be > 0" in str(e.value)


@pytest.mark.parametrize("override,key", [
    ("ppo.pack_sequences=maybe", "'ppo.pack_sequences' = 'maybe' must be true, false or auto"),
    ("actor.gradient_checkpointing=sometimes", "'actor.gradient_checkpointing'"),
    ("ppo.rollout_is=tokens", "'ppo.rollout_is' = 'tokens' is not one of none, token, sequence"),
    ("ppo.rollout_is_cap=0", "'ppo.rollout_is_cap' must be > 0"),
    ("ppo.max_tokens_per_micro_batch=-1", "'ppo.max_tokens_per_micro_batch' must be >= 0"),
])
def test_variable_length_and_mismatch_settings_are_checked(override, key):
    with pytest.raises(ConfigError) as err:
        load_config([], [override])
    assert key in str(err.value)


def test_variable_length_settings_accept_their_values():
    cfg = load_config([], ["ppo.pack_sequences=true", "actor.gradient_checkpointing=auto", "ppo.rollout_is=sequence",
                           "ppo.rollout_is_cap=5", "ppo.max_tokens_per_micro_batch=16384"])
    assert cfg.ppo.pack_sequences is True and cfg.actor.gradient_checkpointing == "auto"


def test_token_budget_and_is_cap_inert_keys():
    cfg = load_config([], ["ppo.max_tokens_per_micro_batch=4096", "ppo.micro_batch_size=4", "ppo.rollout_is_cap=3"])
    inert = dict(inert_keys(cfg, world_size=1))
    assert "max_tokens_per_micro_batch" in inert["ppo.micro_batch_size"]
    assert inert["ppo.rollout_is_cap"] == "ppo.rollout_is is none"
    assert "reward.stream" in dict(inert_keys(load_config([], ["reward.stream=false"]), world_size=2))
def lr_trace(overrides: list[str], steps: int, total_steps: int = 10) -> list[float]:
    """The actor's learning rate at each of ``steps`` optimizer steps under ``overrides``."""
    import torch

    from rlcore.trainer.models import build_optimizer

    optim, sched = build_optimizer(torch.nn.Linear(2, 2), load_config([], overrides).actor, total_steps)
    lrs = []
    for _ in range(steps):
        lrs.append(optim.param_groups[0]["lr"])
        optim.step()
        sched.step()
    return lrs


def test_every_transformers_schedule_is_accepted_and_built():
    from transformers import SchedulerType

    from rlcore.trainer.models import METRIC_SCHEDULES

    extra = {"cosine_with_min_lr": "{min_lr_rate: 0.1}", "cosine_warmup_with_min_lr": "{min_lr_rate: 0.1}",
             "warmup_stable_decay": "{num_decay_steps: 3}"}
    for kind in SchedulerType:
        if kind.value in METRIC_SCHEDULES:
            continue
        overrides = [f"actor.lr_scheduler={kind.value}", "actor.warmup_steps=2", "actor.lr=1.0"]
        if kind.value in extra:
            overrides.append(f"actor.lr_scheduler_kwargs={extra[kind.value]}")
        lrs = lr_trace(overrides, 10)
        assert lrs[1] > 0.9, kind.value  # warmed up on step warmup_steps
        assert 0 < lrs[0] <= 1.0, kind.value  # the first step learns


def test_schedule_names_and_arguments_are_checked_at_load():
    with pytest.raises(ConfigError) as caught:
        load_config([], ["actor.lr_scheduler=cosin", "critic.lr_scheduler=cosine_with_min_lr",
                         "actor.lr_scheduler_kwargs={num_cycles: 2}"])
    text = str(caught.value)
    assert "'actor.lr_scheduler' = 'cosin'" in text and "did you mean 'cosine'" in text
    assert "'critic.lr_scheduler' = 'cosine_with_min_lr'" in text and "min_lr" in text
    with pytest.raises(ConfigError, match="validation metric"):
        load_config([], ["actor.lr_scheduler=reduce_lr_on_plateau"])


def test_old_schedules_keep_their_shape():
    for kind, last in (("constant", 1.0), ("linear", 0.1), ("cosine", 0.0245)):
        assert lr_trace([f"actor.lr_scheduler={kind}", "actor.lr=1.0"], 10)[-1] == pytest.approx(last, abs=1e-3), kind


def test_warmup_starts_at_lr_over_warmup_steps():
    lrs = lr_trace(["actor.lr_scheduler=constant", "actor.lr=1.0", "actor.warmup_steps=4"], 6)
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
