"""``rlcore eval``: score a policy on held-out prompts without training.

The policy (``actor.model_path``: a Hugging Face directory, or an rlcore checkpoint with
``eval.base_model``) generates ``eval.n`` samples for each row of ``data.val_files`` through the
actor's rollout backend (the fast engine where it supports the model); the reward scores them as in
training. The report (pass@k for k = 1..n, mean reward, response lengths, per ``data_source``) is
printed as a table and written as JSON to ``eval.output``. The sampling and scoring are the
trainer's own (:mod:`rlcore.trainer.evaluation`), so the numbers equal those of the trainer's
evaluation of the same policy on the same rows with the same ``eval`` settings.

With no config file and no data (``rlcore eval`` alone) it scores the demo's trained policy
(``runs/demo/final``) on the demo's held-out prompts, with the demo's settings.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from rlcore.errors import ConfigError
from rlcore.protocols import DistInfo
from rlcore.trainer.evaluation import eval_sampling, sample_and_score, summarize
from rlcore.trainer.loop import Trainer

log = logging.getLogger(__name__)

#: Keys whose presence means the user gave held-out data (no demo then).
DATA_KEYS = ("data.val_files", "data.train_files", "data.custom_cls.path")
#: What ``rlcore eval`` adds to the demo preset: the rows the demo's training evaluated.
DEMO_EVAL_OVERRIDES = ("eval.max_prompts=null",)
#: The most pass@k columns the printed table shows (the JSON report has every k).
TABLE_KS = 5


def policy_source(model_path: str, base_model: Optional[str]) -> tuple[str, Optional[Path]]:
    """``(Hugging Face directory, checkpoint or None)`` of ``actor.model_path``: a model directory
    itself, or a checkpoint (a ``step_N`` directory, or a run or ``checkpoints`` directory with a
    ``latest`` pointer) whose architecture and tokenizer are ``eval.base_model`` (default: the
    run's demo model, for a run of the demo).

    :raises ConfigError: the path is neither, or a checkpoint's base model cannot be found.
    """
    from rlcore.trainer.checkpoint import resolve_checkpoint_path

    path = Path(model_path)
    if (path / "config.json").is_file():
        return str(path), None
    if not path.is_dir():
        raise ConfigError([f"'actor.model_path' = {model_path!r}: no such directory"])
    if not any((root / name).exists() for root in (path, path / "checkpoints") for name in ("latest",
                                                                                            "manifest.json")):
        raise ConfigError([f"'actor.model_path' = {model_path!r}: neither a Hugging Face model directory (no "
                           "config.json) nor an rlcore checkpoint (no manifest.json or checkpoints/latest)"])
    ckpt = resolve_checkpoint_path(path)
    if base_model:
        return base_model, ckpt
    demo = ckpt.parent.parent / "_demo" / "demo-model"
    if (demo / "config.json").is_file():
        return str(demo), ckpt
    raise ConfigError([f"'actor.model_path' = {model_path!r} is an rlcore checkpoint ({ckpt}): set 'eval.base_model' "
                       "to the Hugging Face model directory the run started from (its architecture and tokenizer)"])


def load_checkpoint_policy(model: torch.nn.Module, ckpt: Path, dist: DistInfo, seed: int) -> None:
    """The actor's weights of checkpoint ``ckpt`` into ``model`` (verified by its manifest first)."""
    from rlcore.errors import CheckpointError
    from rlcore.trainer.store import manifest as mf
    from rlcore.trainer.store.state import load_state

    problems = mf.verify(ckpt)
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} cannot be used: " + "; ".join(problems))
    manifest = mf.read_manifest(ckpt)
    if "actor" not in manifest.get("kinds", {}):
        raise CheckpointError(f"checkpoint {ckpt} holds no actor weights (it holds {sorted(manifest['kinds'])})")
    load_state(ckpt, manifest, {"actor": model}, dist, seed=seed)
    log.info("policy weights loaded from checkpoint %s (step %s)", ckpt, manifest.get("step"))


class Evaluator:
    """What an evaluation needs of a run, and nothing more: the policy in its generation layout, the
    tokenizer, the reward, the held-out rows. Rows are expanded, played as episodes, scored and
    judged truncated by the trainer's own methods."""

    expand = Trainer.expand
    start_episodes = Trainer.start_episodes
    end_episodes = Trainer.end_episodes
    score = Trainer.score
    truncated = Trainer.truncated
    sampling = Trainer.sampling
    _request = Trainer._request
    plugin_of = Trainer.plugin_of

    def __init__(self, cfg: DictConfig, pm: Any, dist: DistInfo):
        from rlcore.trainer.components import build_episode_runner

        self.cfg, self.pm, self.dist = cfg, pm, dist
        self.tcfg, self.gen_cfg = cfg.trainer, cfg.ppo.generation
        self.n = int(cfg.eval.n)
        self.c, self.rows, self.model_path = _build_parts(cfg, pm, dist)
        self.episodes = build_episode_runner(cfg, pm, self.c.tokenizer)

    @torch.no_grad()
    def run(self) -> dict[str, Any]:
        """The report: the settings, ``all`` and ``by_source`` (see :func:`~rlcore.trainer.evaluation.summarize`)."""
        ev = self.cfg.eval
        params = eval_sampling(ev, self.gen_cfg, self.sampling(0, greedy=True))
        results = sample_and_score(self, self.rows, self.n, params, int(self.gen_cfg.batch_size))
        if not results:
            raise ConfigError(["rlcore eval: no held-out rows to score (data.val_files is empty, or every prompt "
                               "was filtered out as too long)"])
        return {"model": self.model_path, "data": list(self.cfg.data.val_files),
                "eval": {"n": self.n, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                         "max_new_tokens": params.max_new_tokens, "pass_threshold": float(ev.pass_threshold),
                         "seed": int(self.tcfg.seed)},
                **summarize(results, self.n, float(ev.pass_threshold))}


class _Parts:
    """The parts of a run the trainer's row methods read (``tokenizer``, ``reward``, ``generation``, ``eos_ids``)."""

    def __init__(self, tokenizer: Any, reward: Any, generation: Any, eos_ids: list[int]):
        self.tokenizer, self.reward, self.generation, self.eos_ids = tokenizer, reward, generation, eos_ids


def _build_parts(cfg: DictConfig, pm: Any, dist: DistInfo) -> tuple[_Parts, list[dict], str]:
    """The policy (from ``actor.model_path``) in its rollout backend, the tokenizer, the reward and the rows."""
    from rlcore.config.schema import resolve_fsdp
    from rlcore.distributed.fsdp import load_model_for_role
    from rlcore.trainer import models
    from rlcore.trainer.components import _generation, build_placement, build_reward, obj

    actor_cfg, data_cfg = obj(cfg.actor), obj(cfg.data)
    hf_dir, ckpt = policy_source(actor_cfg.model_path, cfg.eval.base_model)
    placement = build_placement(pm, dist, actor_cfg, obj(cfg.critic), obj(cfg.reward_model), obj(cfg.placement),
                                uses_critic=False)
    device = placement.device_for("actor")
    tokenizer = models.load_tokenizer(hf_dir)
    rows = _held_out_rows(cfg, pm, tokenizer, dist)
    reward = build_reward(cfg, pm, placement, tokenizer, dist)
    fsdp = resolve_fsdp(obj(cfg.fsdp), actor_cfg.fsdp)
    reshard = pm.build("rlcore_reshard_policy", fsdp=fsdp, remeshing=actor_cfg.remeshing, dist=dist)

    def load() -> torch.nn.Module:
        model = models.load_causal_lm(hf_dir, actor_cfg.dtype, device, actor_cfg.attn_implementation)
        if ckpt is not None and actor_cfg.lora.rank > 0:
            from rlcore.trainer.lora import add_adapters

            model = add_adapters(model, actor_cfg.lora)
        return model

    module = load_model_for_role(load, fsdp, dist)
    if ckpt is not None:
        load_checkpoint_policy(module, ckpt, dist, int(cfg.trainer.seed))
    module.eval()
    actor = reshard.prepare(module, "actor")
    ppo = obj(cfg.ppo)
    if cfg.eval.max_new_tokens is not None:  # the backend sizes its sequences for the longer of the two
        ppo.generation.max_new_tokens = max(int(ppo.generation.max_new_tokens), int(cfg.eval.max_new_tokens))
    generation = _generation(pm, actor, module, reshard, actor_cfg, data_cfg, ppo, dist)
    eos = tokenizer.eos_token_id
    parts = _Parts(tokenizer, reward, generation, [eos] if isinstance(eos, int) else list(eos or []))
    return parts, rows, str(ckpt) if ckpt is not None else hf_dir


def _held_out_rows(cfg: DictConfig, pm: Any, tokenizer: Any, dist: DistInfo) -> list[dict]:
    """The rows of ``data.val_files`` (the demo's held-out set without data), the first ``eval.max_prompts``
    (0: all; null: ``trainer.eval_samples``), with their prompt ids, as the trainer's evaluation reads them."""
    from rlcore.data.collate import ensure_input_ids
    from rlcore.trainer.components import _load_rows, obj

    data_cfg = obj(cfg.data)
    if data_cfg.train_files and not data_cfg.val_files:
        raise ConfigError(["rlcore eval scores the rows of 'data.val_files', which is empty (data.train_files is "
                           "set): give data.val_files=[...]"])
    ds = pm.build("rlcore_dataset_provider", config=data_cfg, tokenizer=tokenizer, split="val", dist=dist)
    limit = cfg.eval.max_prompts
    limit = int(cfg.trainer.eval_samples) if limit is None else int(limit) or 2**62
    rows = _load_rows(ds, limit)
    return ensure_input_ids(rows, tokenizer, data_cfg, drop_overlong=True) if rows else []


def format_table(report: dict[str, Any]) -> str:
    """The report as a text table: one line per ``data_source`` and one for all of them."""
    n = int(report["eval"]["n"])
    ks = sorted({1, n} | {k for k in (2, 4, 8, 16, 32, 64, 128) if k < n})
    ks = ks[:TABLE_KS - 1] + [n] if len(ks) > TABLE_KS else ks
    head = ["data_source", "prompts", "reward", *[f"pass@{k}" for k in ks], "len mean", "len p90", "len max",
            "clipped"]
    lines = [(name, stats) for name, stats in sorted(report["by_source"].items())]
    if len(lines) != 1:
        lines.append(("all", report["all"]))
    table = [head] + [[name, str(s["prompts"]), f"{s['reward_mean']:.4f}", *[f"{s['pass'][str(k)]:.4f}" for k in ks],
                       f"{s['length_mean']:.1f}", f"{s['length_p90']:.1f}", str(s["length_max"]),
                       f"{s['clip_frac']:.3f}"] for name, s in lines]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(row, widths))) for row in table)


def write_report(report: dict[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=True)
        f.write("\n")


def report_path(cfg: DictConfig) -> str:
    return str(cfg.eval.output or os.path.join(str(cfg.trainer.output_dir), "eval.json"))
