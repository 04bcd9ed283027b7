"""The RL loop. :meth:`Trainer.train` reads top to bottom as the numbered steps of one RL step."""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from rlcore.distributed.init import all_gather_object
from rlcore.protocols import DistInfo, RewardInput
from rlcore.rollout.base import RolloutBatch, SamplingParams
from rlcore.trainer.checkpoint import archive_previous_run
from rlcore.trainer.components import Components, build_components
from rlcore.trainer.experience import (
    Experience,
    batched_logprobs,
    batched_values,
    compute_advantages,
    to_experience,
)
from rlcore.trainer.update import on_policy, ppo_update

log = logging.getLogger(__name__)


class TrainerState:
    """Counters saved with every checkpoint."""

    def __init__(self) -> None:
        self.step = 0
        self.samples = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.samples = int(state["step"]), int(state["samples"])


class Trainer:
    """Owns the components of one run. The config tree is read here only; components get their own sections."""

    def __init__(self, cfg: DictConfig, pm: Any, dist: DistInfo):
        from rlcore.config import check_config

        check_config(cfg)  # values set after load_config (Python API) get the same checks
        self.cfg, self.pm, self.dist = cfg, pm, dist
        self.ppo, self.algo, self.tcfg = cfg.ppo, cfg.algorithm, cfg.trainer
        self.hook = pm.hook
        self.state = TrainerState()
        #: "completed" or "interrupted" once :meth:`train` returns (a failed run raises)
        self.status = "not started"
        self.c: Components = build_components(cfg, pm, dist)
        from rlcore.trainer.components import build_episode_runner

        #: plays rows as multi-turn episodes (``data.env_key``), else None
        self.episodes = build_episode_runner(cfg, pm, self.c.tokenizer)
        self.gen_cfg = self.ppo.generation
        self.n = int(self.gen_cfg.n)
        self._times: dict[str, float] = {}
        # Shuffles mini-batches; registered so a checkpoint restores its stream.
        self._gen = self.c.rng.register("update", torch.Generator().manual_seed(int(self.tcfg.seed)))

    # ------------------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        c = self.c
        if str(self.tcfg.resume or "disable") == "disable" and self.dist.is_main:
            archive_previous_run(self.tcfg.output_dir)  # a fresh run neither overwrites nor prunes an earlier one
        start = c.checkpoint.resume(c.stateful(self.state))
        self.state.step = start
        self.hook.rlcore_train_start(run_dir=self.tcfg.output_dir, dist=self.dist,
                                     config=OmegaConf.to_container(self.cfg, resolve=True))
        before = self.evaluate("before") if start == 0 else {}
        status = "completed"
        c.gpu_monitor.start()
        try:
            with c.graceful_exit() as stop, c.progress(start, self.tcfg.max_steps) as bar:
                for step in range(start + 1, self.tcfg.max_steps + 1):
                    metrics = self.train_step(step)
                    bar.update(metrics)
                    if stop.requested:
                        status = "interrupted"
                        break
        except BaseException:
            status = "failed"
            try:
                self.hook.rlcore_train_end(step=self.state.step, status=status, summary={})
            except Exception:  # never mask the original error
                log.exception("a plugin failed in rlcore_train_end")
            raise
        finally:
            c.gpu_monitor.stop()
            if status != "failed":
                with self.timer("checkpoint"):
                    c.checkpoint.save(self.state.step, c.stateful(self.state))
                getattr(c.checkpoint, "wait", lambda: None)()  # an asynchronous save must land before exit
            c.profiler.close()
        after = self.evaluate("after") if status == "completed" else {}
        summary = {**{f"before/{k}": v for k, v in before.items()}, **{f"after/{k}": v for k, v in after.items()},
                   **c.gpu_monitor.summary()}
        if status == "completed" and self.tcfg.export_final:
            path = c.checkpoint.export(c.actor_module, c.tokenizer, "final")
            if path:
                log.info("final policy exported to %s", path)
        self.hook.rlcore_train_end(step=self.state.step, status=status, summary=summary)
        self.status = status
        return summary

    def train_step(self, step: int) -> dict[str, float]:
        c, m = self.c, {}
        self._times = {}
        t0 = time.perf_counter()
        c.profiler.step_start(step)
        self.hook.rlcore_step_start(step=step)
        # 1. Prompts: this rank's share, each repeated n times.
        rows = c.ensure_ids(c.train_loader.next_batch())
        prompts, extras = self.expand(rows)
        # 2. Rollout in the generation layout (multi-turn rows play their episodes).
        prompts, episodes = self.start_episodes(rows, prompts)
        self.hook.rlcore_before_generation(step=step, prompts=prompts)
        with self.timer("generate"):
            rollout = self.generate(prompts, self.sampling(step))
        self.hook.rlcore_after_generation(step=step, rollout=rollout)
        m.update(self.end_episodes(episodes, extras))
        # 3. Reward.
        with self.timer("reward"):
            scores, m_reward = self.score(rollout, extras)
        # 4. Old and reference log-probs, values (training layout).
        exp = self.make_experience(rollout, scores)
        # 5. Advantages (+ KL in the reward).
        with self.timer("advantages"):
            m.update(compute_advantages(exp, self.algo, self.ppo, c.kl_ctrl.value, self.n))
        # 6. PPO epochs over mini-batches.
        m.update(self.update(exp))
        self.hook.rlcore_after_update(step=step, metrics=m)
        # 7. KL controller, metrics, checkpoint.
        if "kl/mean" in m:
            c.kl_ctrl.update(m["kl/mean"], exp.size)
        self.state.step, self.state.samples = step, self.state.samples + exp.size
        if c.checkpoint.should_save(step):
            with self.timer("checkpoint"):
                c.checkpoint.save(step, c.stateful(self.state))
        reshard = c.reshard.stats()
        m.update(m_reward, **self.rollout_metrics(rollout, scores), **reshard)
        m["time/reshard_s"] = reshard.get("reshard/to_gen_s", 0.0) + reshard.get("reshard/to_train_s", 0.0)
        m.update({f"time/{k}_s": v for k, v in self._times.items()})
        m["time/step_s"] = time.perf_counter() - t0
        m.update(c.perf_metrics(rollout, m["time/step_s"]))
        m["actor/kl_coef"] = c.kl_ctrl.value
        self.hook.rlcore_step_end(step=step, metrics=m)
        c.profiler.step_end(step)
        logged = step % self.tcfg.log_steps == 0 or step == self.tcfg.max_steps
        if logged:
            m.update(c.gpu_monitor.interval_summary())
        m = c.reduce_metrics(m)  # averaged over ranks: what the log, the progress bar and the summary show
        if logged:
            self.hook.rlcore_metrics(step=step, metrics=m, split="train")
        if self.tcfg.eval_steps and step % self.tcfg.eval_steps == 0:
            self.evaluate("step")  # every rank takes part, also one without held-out rows
        return m

    # ------------------------------------------------------------------------------------------
    @contextmanager
    def timer(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self._times[name] = self._times.get(name, 0.0) + time.perf_counter() - t

    def sampling(self, step: int, greedy: bool = False) -> SamplingParams:
        g = self.gen_cfg
        return SamplingParams(max_new_tokens=int(g.max_new_tokens), temperature=0.0 if greedy else float(g.temperature),
                              top_p=float(g.top_p), top_k=int(g.top_k),
                              seed=int(self.tcfg.seed) * 100003 + step * 101 + self.dist.rank,
                              eos_token_ids=tuple(self.c.eos_ids), pad_token_id=int(self.c.tokenizer.pad_token_id))

    def expand(self, rows: list[dict]) -> tuple[list[list[int]], dict[str, list]]:
        key = self.cfg.data.prompt_key
        prompts = [list(r["input_ids"]) for r in rows for _ in range(self.n)]
        cols = sorted({k for r in rows for k in r if k not in ("input_ids",)})
        extras = {k: [r.get(k) for r in rows for _ in range(self.n)] for k in cols}
        extras["prompt_text"] = [r[key] if isinstance(r.get(key), str) else self.c.tokenizer.decode(r["input_ids"])
                                 for r in rows for _ in range(self.n)]
        return prompts, extras

    def start_episodes(self, rows: list[dict], prompts: list[list[int]]) -> tuple[list, list]:
        """With ``data.env_key``: start an episode per sample whose row names an environment; its
        prompt then carries it (and becomes the environment's initial messages if it gives some)."""
        if self.episodes is None:
            return prompts, []
        from rlcore.envs.runner import EpisodePrompt

        key = self.cfg.data.env_key
        samples = [r for r in rows for _ in range(self.n)]
        missing = [r for r in samples if key not in r]
        if missing:
            from rlcore.errors import DataError
            raise DataError(f"data.env_key is '{key}' but a row has no such column; its columns: "
                            f"{', '.join(sorted(missing[0]))}")
        episodes = self.episodes.start([r.get(key) for r in samples], samples)
        out = [EpisodePrompt(getattr(e, "prompt", None) or p, e) if e is not None else p
               for p, e in zip(prompts, episodes)]
        return out, episodes

    def end_episodes(self, episodes: list, extras: dict[str, list]) -> dict[str, float]:
        """The episodes' rewards into the reward's extras (``env_reward``) and their metrics."""
        if not episodes:
            return {}
        from rlcore.envs.runner import episode_metrics

        extras["env_reward"] = [None if e is None else e.reward for e in episodes]
        return episode_metrics(episodes)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutBatch:
        return self.c.generate(prompts, params)

    def score(self, rollout: RolloutBatch, extras: dict[str, list]) -> tuple[torch.Tensor, dict[str, float]]:
        tok = self.c.tokenizer
        # one device-to-host copy per tensor, then per-row work on the host (not 4 syncs per sample)
        resp_ids = _rows(rollout.response_ids, rollout.response_mask)
        responses = tok.batch_decode(resp_ids, skip_special_tokens=True)
        prompt_text = extras.pop("prompt_text")
        batch = RewardInput(prompts=prompt_text, responses=responses,
                            prompt_ids=_rows(rollout.prompt_ids, rollout.prompt_mask),
                            response_ids=resp_ids, extras=extras)
        out = self.c.reward.score(batch)
        scores = out.scores.float().cpu()
        if not torch.isfinite(scores).all():
            bad = int((~torch.isfinite(scores)).nonzero()[0])
            from rlcore.errors import RewardError
            raise RewardError(f"reward backend returned {float(scores[bad])} for sample {bad}: "
                              f"prompt={prompt_text[bad]!r} response={responses[bad]!r}")
        return scores, dict(out.metrics)

    def make_experience(self, rollout: RolloutBatch, scores: torch.Tensor) -> Experience:
        c = self.c
        exp = to_experience(rollout, scores, c.train_device)
        micro = c.micro_batch
        temp = float(self.gen_cfg.temperature)
        trim = exp.response_mask if self.ppo.trim_padding else None  # cut each chunk to its used columns
        c.actor_module.eval()
        if c.ref is None and on_policy(exp.size, self.ppo, int(self.tcfg.gradient_accumulation_steps)):
            exp.old_logprobs = None  # one optimizer step over the rollout: the update's forward gives them
        else:
            with self.timer("old_logprob"):
                exp.old_logprobs = batched_logprobs(c.actor, exp.input_ids, exp.attention_mask,
                                                    exp.response_len, temp, micro, trim)
        if c.ref is not None:
            with self.timer("ref_logprob"):
                exp.ref_logprobs = batched_logprobs(c.ref, exp.input_ids, exp.attention_mask, exp.response_len,
                                                    temp, micro, trim)
        if c.critic is not None:
            with self.timer("values"):
                exp.values = batched_values(c.critic, exp.input_ids, exp.attention_mask, exp.response_len, micro,
                                            trim)
        return exp

    def update(self, exp: Experience) -> dict[str, float]:
        c = self.c
        kl_loss_coef = 0.0 if self.ppo.kl_in_reward else c.kl_ctrl.value
        return ppo_update(exp, actor=c.actor, actor_opt=c.actor_opt, actor_sched=c.actor_sched,
                          actor_grad_clip=self.cfg.actor.grad_clip, critic=c.critic, critic_opt=c.critic_opt,
                          critic_sched=c.critic_sched, critic_grad_clip=self.cfg.critic.grad_clip, ppo=self.ppo,
                          grad_accum=int(self.tcfg.gradient_accumulation_steps),
                          temperature=float(self.gen_cfg.temperature) or 1.0, kl_loss_coef=kl_loss_coef,
                          generator=self._gen)

    def rollout_metrics(self, rollout: RolloutBatch, scores: torch.Tensor) -> dict[str, float]:
        lengths = rollout.response_mask.sum(-1).float()
        max_len = int(self.gen_cfg.max_new_tokens)
        last = rollout.response_ids[:, -1]
        ended = torch.zeros_like(last, dtype=torch.bool)
        for e in self.c.eos_ids:
            ended |= (rollout.response_ids == e).any(-1)
        return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                "reward/min": float(scores.min()), "reward/max": float(scores.max()),
                "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
                "response/clip_frac": float(((lengths >= max_len) & ~ended).float().mean())}

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict[str, float]:
        """Greedy generation on held-out prompts; mean reward over every rank's prompts.

        Ranks may hold different numbers of held-out rows (a provider that shards them); every
        rank still makes the same number of generation calls, since each one gathers the sharded
        weights: a rank with fewer batches generates (and drops) copies of a held-out row."""
        c = self.c
        bs = max(1, int(self.gen_cfg.batch_size))
        batches = [c.val_rows[i:i + bs] for i in range(0, len(c.val_rows), bs)]
        shared = all_gather_object((len(batches), c.val_rows[0] if c.val_rows else None))  # [mine] in one process
        total = max(count for count, _ in shared)
        if not total:
            return {}
        spare = next(row for _, row in shared if row is not None)
        batches += [None] * (total - len(batches))
        sums = {"reward": 0.0, "length": 0.0, "count": 0.0}
        saved_n, self.n = self.n, 1
        try:
            for rows in batches:
                rows_now = rows if rows is not None else [spare]
                prompts, extras = self.expand(rows_now)
                prompts, episodes = self.start_episodes(rows_now, prompts)
                rollout = self.generate(prompts, self.sampling(0, greedy=True))
                self.end_episodes(episodes, extras)
                s, _ = self.score(rollout, extras)
                if rows is not None:
                    sums["reward"] += float(s.sum())
                    sums["length"] += float(rollout.response_mask.sum())
                    sums["count"] += len(rows)
        finally:
            self.n = saved_n
        parts = all_gather_object(sums)
        sums = {k: sum(p[k] for p in parts) for k in sums}
        count = max(sums["count"], 1.0)
        out = {"reward_mean": sums["reward"] / count, "response_length": sums["length"] / count}
        self.hook.rlcore_metrics(step=self.state.step, metrics=dict(out), split="val")
        return out


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """The unmasked tokens of each row of ``ids [B, T]`` as lists, copied to the host once."""
    ids, mask = ids.cpu(), mask.cpu().bool()
    return [row[keep].tolist() for row, keep in zip(ids, mask)]
