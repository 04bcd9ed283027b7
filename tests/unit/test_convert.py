"""``rlcore convert-config``: verl trainer configs (the generated ppo_trainer.yaml shape with a GRPO, a DAPO and a
PPO run script's overrides) and a TRL GRPOConfig as TRL saves it become configs ``rlcore validate`` accepts,
with every key that has no counterpart listed."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rlcore.cli import main
from rlcore.config import load_config
from rlcore.convert import convert, convert_trl, convert_verl, flatten

DATA = Path(__file__).resolve().parents[1] / "data" / "convert"
VERL = DATA / "verl_ppo_trainer.yaml"
TRL = DATA / "trl_grpo_config.json"


def run_script(name: str) -> list[str]:
    return (DATA / f"verl_run_{name}.txt").read_text().split()


def make_inputs(root: Path, cfg) -> None:
    """The data files and model directories a converted config names, so that validate can check them."""
    from rlcore.demo import build_model_dir

    rows = int(cfg.ppo.rollout_batch_size) * int(cfg.trainer.nproc_per_node)
    for f in list(cfg.data.train_files) + list(cfg.data.val_files):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"prompt": [f"a b c {i}" for i in range(rows)]}), root / f)
    for path in {cfg.actor.model_path, cfg.critic.model_path} - {None}:
        if not (root / path / "config.json").exists() and not path.startswith("~"):
            build_model_dir(str(root / path))


@pytest.mark.parametrize("script", ["grpo", "dapo", "ppo"])
def test_verl_run_scripts_convert_to_configs_validate_accepts(script, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "converted.yaml"
    assert main(["convert-config", "--from", "verl", str(VERL), *run_script(script), "-o", str(out)]) == 0
    err = capsys.readouterr().err
    cfg = load_config([str(out)])
    make_inputs(tmp_path, cfg)
    assert main(["validate", "--config", str(out)]) == 0, capsys.readouterr().err
    # nothing dropped silently: every source key is mapped or listed, in the file's header and on stderr
    conv = convert("verl", str(VERL), run_script(script))
    source = set(flatten(yaml.safe_load(VERL.read_text()))) | {o.split("=")[0].lstrip("+") for o in run_script(script)}
    assert source <= set(conv.mapped) | set(conv.unmapped)
    header = out.read_text()
    for key in conv.unmapped:  # every key in the file's header; a summary by reason, in a screen, on stderr
        assert f"#   {key} = " in header
    assert f"{len(conv.unmapped)} without an rlcore counterpart, by reason" in err and len(err.splitlines()) <= 30
    assert "trainer.project_name" in conv.unmapped and "actor_rollout_ref.rollout.gpu_memory_utilization" in conv.mapped


def test_verl_grpo_mapping():
    conv = convert_verl(yaml.safe_load(VERL.read_text()), run_script("grpo"))
    v = conv.values
    assert v["algorithm.adv_estimator"] == "grpo" and v["ppo.generation.n"] == 5
    assert v["ppo.kl_in_reward"] is False and v["ppo.kl_coeff"] == 0.001 and v["ppo.kl_estimator"] == "low_var_kl"
    assert v["ppo.rollout_batch_size"] == 1024 // 8  # verl: prompts over 8 GPUs; rlcore: per rank
    assert v["ppo.mini_batch_size"] == 256 * 5 // 8  # verl: prompts; rlcore: samples per rank
    assert v["actor.lr"] == 1e-6 and isinstance(v["actor.lr"], float)
    assert v["ppo.generation.max_new_tokens"] == 1024 and v["ppo.generation.top_k"] == 0
    assert v["ppo.dual_clip"] == 3.0 and v["trainer.eval_steps"] == 5
    assert not any(k.startswith("critic.") for k in v)  # GRPO trains no critic: listed instead
    assert "trainer.total_epochs" in conv.unmapped


def test_verl_dapo_mapping():
    conv = convert_verl(yaml.safe_load(VERL.read_text()), run_script("dapo"))
    v = conv.values
    assert v["ppo.cliprange"] == 0.2 and v["ppo.cliprange_high"] == 0.28 and v["ppo.loss_agg"] == "token-mean"
    assert v["algorithm.dynamic_sampling.enable"] is True and v["algorithm.dynamic_sampling.max_rounds"] == 9
    assert v["algorithm.overlong_buffer.length"] == 4096 and v["algorithm.overlong_buffer.penalty_factor"] == 1.0
    assert v["ppo.kl_coeff"] == 0.0 and v["algorithm.use_reference"] is False
    assert v["ppo.rollout_batch_size"] == 512 // 128 and v["actor.fsdp.cpu_offload"] is True
    assert "trainer.nnodes" in conv.unmapped and "data.gen_batch_size" in conv.unmapped


@pytest.mark.parametrize("mode,expected", [("gspo", "gspo"), ("cispo", "cispo"), ("clip_cov", None)])
def test_verl_policy_loss_modes(mode, expected):
    conv = convert_verl(yaml.safe_load(VERL.read_text()),
                        run_script("grpo") + [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}"])
    assert conv.values.get("ppo.policy_loss") == expected
    assert "ppo.dual_clip" not in conv.values  # verl's dual clip belongs to the vanilla loss
    if expected is None:
        assert "actor_rollout_ref.actor.policy_loss.loss_mode" in conv.unmapped


def test_verl_ppo_mapping():
    conv = convert_verl(yaml.safe_load(VERL.read_text()), run_script("ppo"))
    v = conv.values
    assert v["algorithm.adv_estimator"] == "gae" and v["critic.lr"] == 1e-5 and v["ppo.cliprange_value"] == 0.5
    assert v["ppo.kl_in_reward"] is True and v["ppo.kl_estimator"] == "kl" and v["ppo.kl_ctrl"] == "fixed"
    assert v["trainer.max_steps"] == 435


def test_trl_grpo_config_converts_and_validates(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "converted.yaml"
    assert main(["convert-config", "--from", "trl", str(TRL), "-o", str(out)]) == 0
    assert main(["validate", "--config", str(out)]) == 0, capsys.readouterr().err
    import json

    conv = convert_trl(json.loads(TRL.read_text()))
    v = conv.values
    assert v["ppo.loss_agg"] == "token-mean" and v["ppo.cliprange_high"] == 0.28  # loss_type dapo, epsilon_high
    assert v["algorithm.mask_truncated"] is True and v["algorithm.norm_adv_by_std"] is True
    assert v["ppo.kl_coeff"] == 0.0 and v["algorithm.use_reference"] is False  # beta 0: no reference model
    # 8 completions per device x 4 steps per generation / 8 generations = 4 prompts per rank
    assert v["ppo.rollout_batch_size"] == 4 and v["ppo.mini_batch_size"] == 32 and v["ppo.micro_batch_size"] == 8
    assert set(flatten(json.loads(TRL.read_text()))) <= set(conv.mapped) | set(conv.unmapped)
    assert {"use_vllm", "report_to", "delta", "vllm_importance_sampling_correction"} <= set(conv.unmapped)


@pytest.mark.parametrize("overrides,expected", [
    (["loss_type=dr_grpo", "scale_rewards=false"], {"ppo.loss_agg": "seq-mean-token-sum-norm",
                                                    "algorithm.norm_adv_by_std": False}),
    (["importance_sampling_level=sequence", "loss_type=grpo"], {"ppo.policy_loss": "gspo",
                                                                "ppo.loss_agg": "seq-mean-token-mean"}),
    (["beta=0.04"], {"ppo.kl_coeff": 0.04, "ppo.kl_estimator": "k3", "ppo.kl_in_reward": False}),
])
def test_trl_switches(overrides, expected):
    import json

    conv = convert_trl(json.loads(TRL.read_text()), overrides)
    for key, value in expected.items():
        assert conv.values[key] == value
    assert "algorithm.use_reference" not in conv.values or conv.values["ppo.kl_coeff"] == 0


def test_convert_errors_name_the_problem(tmp_path):
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match="no such file"):
        convert("verl", str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        convert("trl", str(bad))


#: verl keys with an rlcore counterpart that a conversion must carry (a GRPO run with dynamic batch sizes and a
#: cosine schedule with a floor), and where each must land.
VERL_MUST_MAP = {
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ("ppo.max_tokens_per_micro_batch", 16384),
    "actor_rollout_ref.actor.use_dynamic_bsz": ("ppo.max_tokens_per_micro_batch", 16384),
    "actor_rollout_ref.rollout.gpu_memory_utilization": ("actor.rollout_engine.kv_memory_fraction", 0.6),
    "actor_rollout_ref.actor.optim.min_lr_ratio": ("actor.lr_scheduler", "cosine_with_min_lr"),
    "actor_rollout_ref.actor.optim.clip_grad": ("actor.grad_clip", 1.0),
    "actor_rollout_ref.actor.optim.betas": ("actor.betas", [0.9, 0.999]),
    "actor_rollout_ref.actor.use_torch_compile": ("actor.compile", True),
    "actor_rollout_ref.rollout.val_kwargs.n": ("eval.n", 1),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": ("eval.temperature", 0.0),
}


def test_verl_knobs_rlcore_has_are_carried(tmp_path, monkeypatch, capsys):
    overrides = run_script("grpo") + ["actor_rollout_ref.actor.use_dynamic_bsz=true",
                                      "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                                      "actor_rollout_ref.actor.optim.min_lr_ratio=0.1"]
    conv = convert_verl(yaml.safe_load(VERL.read_text()), overrides)
    for src, (key, value) in VERL_MUST_MAP.items():
        assert src not in conv.unmapped and key in conv.mapped[src], src
        assert conv.values[key] == value, key
    assert conv.values["actor.lr_scheduler_kwargs"] == {"min_lr_rate": 0.1}
    assert "ppo.micro_batch_size" not in conv.values  # verl cuts by tokens then, not by samples
    for key in ("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "actor_rollout_ref.model.use_remove_padding",
                "actor_rollout_ref.actor.optim.optimizer"):
        assert key in conv.mapped, key
    # the converted run loads, and its optimizer is AdamW with the source's betas and eps
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run.yaml"
    assert main(["convert-config", "--from", "verl", str(VERL), *overrides, "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert len(err.splitlines()) <= 30 and "keys, e.g." in err and "unmapped actor_rollout_ref" not in err
    cfg = load_config([str(out)])
    assert cfg.ppo.max_tokens_per_micro_batch == 16384 and cfg.actor.lr_scheduler == "cosine_with_min_lr"


def test_verl_ppo_critic_and_cosine_without_floor():
    conv = convert_verl(yaml.safe_load(VERL.read_text()), run_script("ppo") + [
        "critic.optim.clip_grad=0.5", "critic.optim.lr_scheduler_type=cosine", "critic.optim.lr_warmup_steps=3",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "actor_rollout_ref.actor.optim.num_cycles=2"])
    v = conv.values
    assert v["critic.grad_clip"] == 0.5 and v["critic.lr_scheduler"] == "cosine" and v["critic.warmup_steps"] == 3
    assert v["critic.betas"] == [0.9, 0.999] and v["actor.lr_scheduler_kwargs"] == {"num_cycles": 2.0}
    assert "critic.loss_agg_mode" in conv.mapped and "critic.optim.min_lr_ratio" in conv.mapped
    bad = convert_verl(yaml.safe_load(VERL.read_text()), run_script("ppo") + ["critic.loss_agg_mode=seq-mean-token-sum"])
    assert "token mean" in bad.unmapped["critic.loss_agg_mode"][1]


#: TRL GRPOConfig keys with an rlcore counterpart that a conversion must carry.
TRL_MUST_MAP = {"adam_beta1": "actor.betas", "adam_beta2": "actor.betas", "adam_epsilon": "actor.eps",
                "learning_rate": "actor.lr", "max_grad_norm": "actor.grad_clip", "lr_scheduler_type": "actor.lr_scheduler",
                "num_generations": "ppo.generation.n", "beta": "ppo.kl_coeff", "max_completion_length":
                "ppo.generation.max_new_tokens", "per_device_train_batch_size": "ppo.rollout_batch_size"}


def test_trl_default_config_knobs_are_carried():
    import json

    cfg = json.loads(TRL.read_text())
    conv = convert_trl(cfg, ["lr_scheduler_type=cosine_with_min_lr", "lr_scheduler_kwargs={min_lr_rate: 0.1}",
                             "warmup_ratio=0.1", "warmup_steps=0"])
    for src, key in TRL_MUST_MAP.items():
        assert src not in conv.unmapped and key in conv.mapped[src], src
    v = conv.values
    assert v["actor.betas"] == [cfg["adam_beta1"], cfg["adam_beta2"]] and v["actor.eps"] == cfg["adam_epsilon"]
    assert v["actor.lr_scheduler"] == "cosine_with_min_lr" and v["actor.lr_scheduler_kwargs"] == {"min_lr_rate": 0.1}
    assert v["actor.warmup_steps"] == int(0.1 * cfg["max_steps"])


def test_adamw_betas_and_eps_reach_the_optimizer():
    import torch

    from rlcore.config.schema import ActorConfig
    from rlcore.trainer.models import build_optimizer

    role = ActorConfig(betas=[0.8, 0.99], eps=1e-6)
    opt, _ = build_optimizer(torch.nn.Linear(2, 2), role, 10)
    assert opt.param_groups[0]["betas"] == (0.8, 0.99) and opt.param_groups[0]["eps"] == 1e-6
    from rlcore.errors import ConfigError

    with pytest.raises(ConfigError, match="'actor.betas' must be two numbers in"):
        load_config([], ["actor.betas=[0.9]"])
@pytest.mark.parametrize("source, where, key", [
    ("verl", "file", "data.train_batch_size"),
    ("verl", "override", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("trl", "file", "per_device_train_batch_size"),
    ("trl", "override", "num_generations"),
])
def test_an_unresolvable_interpolation_in_a_batch_size_is_an_error_naming_the_key(tmp_path, capsys, source, where,
                                                                                  key):
    import json

    from rlcore.errors import EXIT_ERROR

    cfg = yaml.safe_load(VERL.read_text()) if source == "verl" else json.loads(TRL.read_text())
    overrides = []
    if where == "file":
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = "${oc.env:BATCH}"
    else:
        overrides = [f"{key}=${{missing.key}}"]
    path = tmp_path / ("cfg.json" if source == "trl" else "cfg.yaml")
    path.write_text(json.dumps(cfg) if source == "trl" else yaml.safe_dump(cfg))
    code = main(["convert-config", "--from", source, str(path), *overrides])
    err = capsys.readouterr().err
    assert code == EXIT_ERROR, err
    assert f"{key} = '${{" in err and "cannot be resolved" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("content", [b"\xff\xfe\x00\x01binary\x80\x81", b"\x00\x01\x02\x03"])
def test_a_binary_file_is_an_error_not_a_traceback(tmp_path, capsys, content):
    from rlcore.errors import EXIT_ERROR

    path = tmp_path / "model.bin"
    path.write_bytes(content)
    code = main(["convert-config", "--from", "verl", str(path)])
    err = capsys.readouterr().err
    assert code == EXIT_ERROR, err
    assert str(path) in err and "Traceback" not in err
    assert main(["convert-config", "--from", "trl", str(tmp_path)]) == EXIT_ERROR  # a directory
