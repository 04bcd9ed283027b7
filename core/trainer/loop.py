"""The RL loop. :meth:`Trainer.train` reads top to bottom as the numbered steps of one RL step."""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

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
        # 1-3. Prompts (this rank's share, each repeated n times), rollout in the generation layout,
        # reward; with dynamic sampling, more rounds until the batch holds enough informative groups.
        batch = self.collect(step)
        rollout, scores = batch.rollout, batch.scores
        m.update(batch.metrics)
        if len(scores):
            # 4. Old and reference log-probs, values (training layout).
            exp = self.make_experience(rollout, scores)
            exp.group_ids, exp.baseline = batch.group_ids.to(exp.scores.device), batch.baseline
            if self.algo.mask_truncated:
                exp.loss_mask = (~batch.truncated).float().to(exp.scores.device)
            # 5. Advantages (+ KL in the reward).
            with self.timer("advantages"):
                m.update(compute_advantages(exp, self.algo, self.ppo, c.kl_ctrl.value, self.n))
            # 6. PPO epochs over mini-batches.
            m.update(self.update(exp))
        else:  # dynamic sampling kept no group on some rank: nothing to learn from this step
            log.warning("step %d: no informative group to train on; the update is skipped", step)
        self.hook.rlcore_after_update(step=step, metrics=m)
        # 7. KL controller, metrics, checkpoint.
        if "kl/mean" in m:
            c.kl_ctrl.update(m["kl/mean"], len(scores))
        self.state.step, self.state.samples = step, self.state.samples + len(scores)
        if c.checkpoint.should_save(step):
            with self.timer("checkpoint"):
                c.checkpoint.save(step, c.stateful(self.state))
        reshard = c.reshard.stats()
        m.update(batch.reward_metrics, **self.rollout_metrics(rollout, batch.raw_scores), **reshard)
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

    def sampling(self, step: int, greedy: bool = False, round: int = 0) -> SamplingParams:
        """Sampling settings of ``step``; each extra rollout ``round`` of a step (dynamic sampling) has its own seed."""
        g = self.gen_cfg
        return SamplingParams(max_new_tokens=int(g.max_new_tokens), temperature=0.0 if greedy else float(g.temperature),
                              top_p=float(g.top_p), top_k=int(g.top_k),
                              seed=int(self.tcfg.seed) * 100003 + step * 101 + self.dist.rank + round * 1000003,
                              eos_token_ids=tuple(self.c.eos_ids), pad_token_id=int(self.c.tokenizer.pad_token_id))

    def expand(self, rows: list[dict], n: int | None = None) -> tuple[list[list[int]], dict[str, list]]:
        """Each row's prompt ``n`` times (default ``ppo.generation.n``), with the rows' other columns."""
        key = self.cfg.data.prompt_key
        n = self.n if n is None else n
        prompts = [list(r["input_ids"]) for r in rows for _ in range(n)]
        cols = sorted({k for r in rows for k in r if k not in ("input_ids",)})
        extras = {k: [r.get(k) for r in rows for _ in range(n)] for k in cols}
        extras["prompt_text"] = [r[key] if isinstance(r.get(key), str) else self.c.tokenizer.decode(r["input_ids"])
                                 for r in rows for _ in range(n)]
        return prompts, extras

    def sample_round(self, rows: list[dict], step: int, round: int = 0) -> "Sampled":
        """Generate ``n`` responses for each of ``rows`` and score them (with overlong shaping, and
        the greedy baseline of ReMax)."""
        prompts, extras = self.expand(rows)
        self.hook.rlcore_before_generation(step=step, prompts=prompts)
        with self.timer("generate"):
            rollout = self.generate(prompts, self.sampling(step, round=round))
        self.hook.rlcore_after_generation(step=step, rollout=rollout)
        with self.timer("reward"):
            raw, m_reward = self.score(rollout, extras)
        scores, shaping = self.shape_scores(rollout, raw)
        m_reward.update(shaping)
        baseline = None
        if self.algo.adv_estimator == "remax":
            with self.timer("remax_baseline"):
                greedy_prompts, greedy_extras = self.expand(rows, n=1)
                greedy = self.generate(greedy_prompts, self.sampling(step, greedy=True, round=round))
                b_raw, _ = self.score(greedy, greedy_extras)
                b_scores, _ = self.shape_scores(greedy, b_raw)
                baseline = b_scores.repeat_interleave(self.n)
        return Sampled(rollout=rollout, scores=scores, raw_scores=raw, reward_metrics=m_reward,
                       truncated=self.truncated(rollout), baseline=baseline,
                       group_ids=torch.arange(len(rows)).repeat_interleave(self.n))

    def collect(self, step: int) -> "Sampled":
        """This step's scored samples. With ``algorithm.dynamic_sampling`` (DAPO), groups whose raw
        rewards are all equal are dropped and more prompts drawn (all ranks draw the same number of
        rounds, at most ``max_rounds`` extra) until ``ppo.rollout_batch_size`` groups are kept; every
        rank then keeps as many groups as the rank with the fewest, so the update's steps line up."""
        c = self.c
        ds = self.algo.dynamic_sampling
        rows = c.ensure_ids(c.train_loader.next_batch())
        first = self.sample_round(rows, step)
        if not ds.enable:
            return first
        target = int(c.ensure_ids.size)  # ppo.rollout_batch_size, resolved when "auto"
        kept: list[Sampled] = []
        n_kept = drawn = dropped = rounds = 0
        dropped_reward = 0.0
        batch = first
        while True:
            groups = batch.raw_scores.view(-1, self.n)
            informative = groups.max(dim=1).values != groups.min(dim=1).values
            drawn += len(groups)
            dropped += int((~informative).sum())
            dropped_reward += float(groups[~informative, 0].sum())
            keep = informative.nonzero().flatten()[:max(0, target - n_kept)]
            if len(keep):
                kept.append(batch.select_groups(keep, self.n))
                n_kept += len(keep)
            short = any(all_gather_object(n_kept < target))
            if not short or rounds >= int(ds.max_rounds):
                break
            rounds += 1
            rows = c.ensure_ids(c.train_loader.next_batch())
            batch = self.sample_round(rows, step, round=rounds)
        fewest = min(all_gather_object(n_kept))
        if fewest < target:
            log.warning("step %d: dynamic sampling kept %d of %d groups after %d extra round(s) "
                        "(algorithm.dynamic_sampling.max_rounds=%d); training on %d group(s)", step, n_kept, target,
                        rounds, int(ds.max_rounds), fewest)
        out = Sampled.concat(kept, self.n, int(self.c.tokenizer.pad_token_id), fewest) if fewest else \
            first.select_groups(torch.zeros(0, dtype=torch.long), self.n)
        out.metrics = {"dynamic_sampling/groups_drawn": float(drawn), "dynamic_sampling/groups_dropped": float(dropped),
                       "dynamic_sampling/dropped_reward_mean": dropped_reward / max(1, dropped),
                       "dynamic_sampling/groups_kept": float(fewest), "dynamic_sampling/extra_rounds": float(rounds),
                       "dynamic_sampling/dropped_frac": dropped / max(1, drawn)}
        return out

    def shape_scores(self, rollout: RolloutBatch, scores: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The scores with DAPO's overlong penalty added (``algorithm.overlong_buffer``), and its metrics."""
        ob = self.algo.overlong_buffer
        if not ob.length:
            return scores, {}
        from rlcore import rlmath

        penalty = rlmath.overlong_penalty(rollout.response_mask.sum(-1).cpu(), int(self.gen_cfg.max_new_tokens),
                                          int(ob.length), float(ob.penalty_factor))
        return scores + penalty, {"reward/overlong_penalty_mean": float(penalty.mean()),
                                  "reward/overlong_frac": float((penalty < 0).float().mean())}

    def truncated(self, rollout: RolloutBatch) -> torch.Tensor:
        """``[B]`` bool: responses cut at ``ppo.generation.max_new_tokens`` without an end-of-sequence token."""
        lengths = rollout.response_mask.sum(-1)
        ended = torch.zeros(rollout.response_ids.shape[0], dtype=torch.bool, device=rollout.response_ids.device)
        for e in self.c.eos_ids:
            ended |= ((rollout.response_ids == e) & rollout.response_mask.bool()).any(-1)
        return ((lengths >= int(self.gen_cfg.max_new_tokens)) & ~ended).cpu()

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
        if not len(scores):
            return {}
        lengths = rollout.response_mask.sum(-1).float()
        return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                "reward/min": float(scores.min()), "reward/max": float(scores.max()),
                "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
                "response/clip_frac": float(self.truncated(rollout).float().mean())}

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
        for rows in batches:
            prompts, extras = self.expand(rows if rows is not None else [spare], n=1)
            rollout = self.generate(prompts, self.sampling(0, greedy=True))
            s, _ = self.score(rollout, extras)
            if rows is not None:
                sums["reward"] += float(s.sum())
                sums["length"] += float(rollout.response_mask.sum())
                sums["count"] += len(rows)
        parts = all_gather_object(sums)
        sums = {k: sum(p[k] for p in parts) for k in sums}
        count = max(sums["count"], 1.0)
        out = {"reward_mean": sums["reward"] / count, "response_length": sums["length"] / count}
        self.hook.rlcore_metrics(step=self.state.step, metrics=dict(out), split="val")
        return out


@dataclass
class Sampled:
    """Scored samples of one step: ``B`` samples in groups of ``n`` consecutive ones (one prompt each)."""

    rollout: RolloutBatch
    scores: torch.Tensor  # [B] what the advantages see (overlong penalty included)
    raw_scores: torch.Tensor  # [B] the reward backend's scores
    reward_metrics: dict[str, float]
    truncated: torch.Tensor  # [B] bool
    group_ids: torch.Tensor  # [B] long
    baseline: Optional[torch.Tensor] = None  # [B] ReMax greedy baseline
    metrics: dict[str, float] = field(default_factory=dict)

    def select_groups(self, groups: torch.Tensor, n: int) -> "Sampled":
        """The samples of the given groups (indices into this batch's groups), in that order."""
        idx = (groups.view(-1, 1) * n + torch.arange(n)).flatten()
        r = self.rollout
        rollout = RolloutBatch(prompt_ids=r.prompt_ids[idx.to(r.prompt_ids.device)],
                               prompt_mask=r.prompt_mask[idx.to(r.prompt_ids.device)],
                               response_ids=r.response_ids[idx.to(r.response_ids.device)],
                               response_mask=r.response_mask[idx.to(r.response_ids.device)],
                               logprobs=r.logprobs[idx.to(r.logprobs.device)], stats=dict(r.stats))
        return Sampled(rollout=rollout, scores=self.scores[idx], raw_scores=self.raw_scores[idx],
                       reward_metrics=dict(self.reward_metrics), truncated=self.truncated[idx],
                       group_ids=self.group_ids[idx], baseline=None if self.baseline is None else self.baseline[idx],
                       metrics=dict(self.metrics))

    @staticmethod
    def concat(parts: list["Sampled"], n: int, pad_token_id: int, groups: int) -> "Sampled":
        """The first ``groups`` groups of ``parts`` joined, group ids renumbered so no two parts share one."""
        from rlcore.rollout.base import concat_batches

        ids, offset = [], 0
        for p in parts:
            ids.append(p.group_ids + offset)
            offset += int(p.group_ids.max()) + 1 if len(p.group_ids) else 0
        metrics: dict[str, list[float]] = {}
        for p in parts:
            for k, v in p.reward_metrics.items():
                metrics.setdefault(k, []).append(v)
        joined = Sampled(rollout=concat_batches([p.rollout for p in parts], pad_token_id),
                         scores=torch.cat([p.scores for p in parts]), raw_scores=torch.cat([p.raw_scores for p in parts]),
                         reward_metrics={k: sum(v) / len(v) for k, v in metrics.items()},
                         truncated=torch.cat([p.truncated for p in parts]), group_ids=torch.cat(ids),
                         baseline=None if parts[0].baseline is None else torch.cat([p.baseline for p in parts]))
        return joined.select_groups(torch.arange(groups), n)


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """The unmasked tokens of each row of ``ids [B, T]`` as lists, copied to the host once."""
    ids, mask = ids.cpu(), mask.cpu().bool()
    return [row[keep].tolist() for row, keep in zip(ids, mask)]
