"""The RL loop. :meth:`Trainer.train` reads top to bottom as the numbered steps of one RL step."""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from rlcore.contract import check_resume_step
from rlcore.distributed.init import all_gather_object, all_reduce_mean
from rlcore.observe.progress import ProgressBar
from rlcore.observe.step_perf import PhaseClock, StepPerf
from rlcore.protocols import DistInfo, RolloutSource
from rlcore.rollout.base import RolloutBatch, SamplingParams
from rlcore.trainer.checkpoint import GracefulExit, archive_previous_run
from rlcore.trainer import overlap as overlap_update
from rlcore.trainer.components import Components, build_components
from rlcore.trainer.experience import (
    Experience,
    batched_logprobs,
    batched_values,
    compute_advantages,
    to_experience,
)
from rlcore.errors import CheckpointError, TrainingError
from rlcore.trainer.partial import PartialSource, check_world
from rlcore.trainer.partial import enabled as partial_enabled
from rlcore.trainer.scoring import RolloutRequest, StreamingScorer, score_rollout
from rlcore.trainer.sizes import host_sizes
from rlcore.trainer.scoring import rows as _rows
from rlcore.trainer.sampled import Sampled  # noqa: F401 - part of this module's API (rollout sources return it)
from rlcore.trainer.sources import InPlaceSource, WholeWorld  # noqa: F401 - WholeWorld: part of this module's API
from rlcore.trainer.update import Accumulated, NonFiniteGuard, on_policy, params_finite, ppo_update

log = logging.getLogger(__name__)


class TrainerState:
    """Counters saved with every checkpoint."""

    def __init__(self, seed: int = 0) -> None:
        self.step = 0
        self.samples = 0
        self.seed = int(seed)
        #: ``trainer.seed`` of the run that wrote the checkpoint resumed from (None: fresh, or not recorded).
        self.saved_seed: int | None = None

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "samples": self.samples, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.samples = int(state["step"]), int(state["samples"])
        self.saved_seed = int(state["seed"]) if "seed" in state else None


class Trainer:
    """Owns the components of one run. The config tree is read here only; components get their own sections."""

    def __init__(self, cfg: DictConfig, pm: Any, dist: DistInfo, split: Any = None):
        from rlcore.config import check_config

        check_config(cfg)  # values set after load_config (Python API) get the same checks
        pm.configure(OmegaConf.to_container(cfg.plugin_config, resolve=True))  # each plugin's own settings
        if dist.is_main:
            from rlcore.config.loader import config_warnings

            for warning in config_warnings(cfg):
                log.warning("%s", warning)
        check_world(cfg, dist.world_size, split)  # partial rollouts: one process (before any model loads)
        self.cfg, self.pm, self.dist = cfg, pm, dist
        self.ppo, self.algo, self.tcfg = cfg.ppo, cfg.algorithm, cfg.trainer
        self.hook = pm.hook
        self.state = TrainerState(int(cfg.trainer.seed))
        #: "completed" or "interrupted" once :meth:`train` returns (a failed run raises)
        self.status = "not started"
        self.c: Components = build_components(cfg, pm, dist)
        from rlcore.trainer.components import build_episode_runner

        #: plays rows as multi-turn episodes (``data.env_key``), else None
        self.episodes = build_episode_runner(cfg, pm, self.c.tokenizer)
        self.gen_cfg = self.ppo.generation
        self.n = int(self.gen_cfg.n)
        self._last_save_s: float | None = None
        #: the step whose state the checkpoint policy last saved (or resumed from): never saved again
        self._saved_step: int | None = None
        # Shuffles mini-batches; registered so a checkpoint restores its stream.
        self._gen = self.c.rng.register("update", torch.Generator().manual_seed(int(self.tcfg.seed)))
        self.guard = NonFiniteGuard(int(self.tcfg.max_nonfinite_steps))
        #: the step's throughput, MFU and memory metrics
        self.perf = StepPerf(self.c.policy.config, self.c.train_device, dist.world_size)
        #: the step's timed phases: their seconds and the allocator's cache flushes in each
        self.clock = PhaseClock(self.perf)
        #: what was logged once for the run (e.g. why ``ppo.overlap_update`` does not apply)
        self.notes: set[str] = set()
        #: where each step's scored samples come from: generated here (:meth:`collect`), or (``split``: a
        #: plugin's :class:`~rlcore.protocols.WorldSplit` and this rank's place in it) from the rollout ranks
        #: with ``ppo.partial_rollout`` (a segment or tail rows), unfinished samples carry over (:mod:`rlcore.trainer.partial`)
        self.source: RolloutSource = (PartialSource(self) if partial_enabled(self.ppo) else
                                      InPlaceSource(self) if split is None else
                                      split[0].rollout_source(self, split[1]))

    def stateful(self) -> dict[str, Any]:
        """Everything a checkpoint holds; the data position is the rollout source's."""
        return {**self.c.stateful(self.state), "data": self.source.data_state()}

    # ------------------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Run the training loop; every factory answer the run built is closed when it ends, whatever the outcome."""
        try:
            return self._train()
        finally:
            self.close()

    def close(self) -> None:
        """Release what the run built: the episode runner, the rollout backends and every other factory
        answer (``close()`` where it has one). Called by :meth:`train` when it ends."""
        if self.episodes is not None:
            self.episodes.close()
        self.c.close()

    def plugin_of(self, role: str) -> str:
        """The plugin that built the run's ``role`` component (``reward``, ``checkpoint`` …), for errors."""
        built = getattr(self.c, "built", None)
        return built.plugin(role) if built is not None else role

    def _train(self) -> dict[str, float]:
        c = self.c
        if str(self.tcfg.resume or "disable") == "disable" and self.dist.is_main:
            archive_previous_run(self.tcfg.output_dir)  # a fresh run neither overwrites nor prunes an earlier one
        start = check_resume_step(c.checkpoint.resume(self.stateful()), self.plugin_of("checkpoint"))
        self.state.step = start
        if start:
            self._saved_step = start
            c.generation.weights_changed()  # the loaded weights reach the rollout backends before they generate
        if start and self.dist.is_main:
            self.report_ignored_settings()
            if start >= int(self.tcfg.max_steps):
                log.info("the checkpoint of step %d reaches trainer.max_steps=%d: nothing to train", start,
                         int(self.tcfg.max_steps))
        self.hook.rlcore_train_start(run_dir=self.tcfg.output_dir, dist=self.dist,
                                     config=OmegaConf.to_container(self.cfg, resolve=True))
        before = self.evaluate("before") if start == 0 else {}
        status = "completed"
        try:
            with GracefulExit() as stop, self.progress(start) as bar:
                for step in range(start + 1, self.tcfg.max_steps + 1):
                    metrics = self.train_step(step)
                    bar.update(metrics)
                    if stop.requested:
                        status = "interrupted"
                        break
            self.save_last()
        except BaseException:
            status = "failed"
            try:
                self.hook.rlcore_train_end(step=self.state.step, status=status, summary={})
            except Exception:  # never mask the original error
                log.exception("a plugin failed in rlcore_train_end")
            raise
        finally:  # after the save: a peer lost on the way out costs no step; also when no step ran
            self.source.close(failed=status == "failed")
        after = self.evaluate("after") if status == "completed" else {}
        summary = {**{f"before/{k}": v for k, v in before.items()}, **{f"after/{k}": v for k, v in after.items()}}
        if status == "completed" and self.tcfg.export_final:
            if not params_finite(c.policy):
                self.status = "failed"
                self.hook.rlcore_train_end(step=self.state.step, status="failed", summary=summary)
                raise TrainingError("the policy's weights are not finite: the final policy was not exported "
                                    f"to {self.tcfg.output_dir}/final; the last checkpoint holds the last finite state")
            try:
                path = c.checkpoint.export(c.policy, c.tokenizer, "final")
            except CheckpointError:  # a full disk, say: the run's plugins hear that it failed
                self.status = "failed"
                self.hook.rlcore_train_end(step=self.state.step, status="failed", summary=summary)
                raise
            if path:
                log.info("final policy exported to %s", path)
        self.hook.rlcore_train_end(step=self.state.step, status=status, summary=summary)  # plugins may add to it
        self.status = status
        return summary

    def train_step(self, step: int) -> dict[str, float]:
        c, m = self.c, {}
        self.clock.reset()
        t0 = time.perf_counter()
        self.hook.rlcore_step_start(step=step)
        # 1-3. Prompts (this rank's share, each repeated n times), rollout in the generation layout,
        # reward; with dynamic sampling, more rounds until the batch holds enough informative groups.
        # Generated here (InPlaceSource: collect), or received from a plugin's rollout ranks.
        batch = self.source.next(step)
        rollout, scores = batch.rollout, batch.scores
        m.update(batch.metrics)
        if len(scores):
            # 4-5. Old and reference log-probs, values (training layout); advantages (+ KL in the reward).
            exp, adv_metrics = self.experience(batch)
            m.update(adv_metrics)
            # 6. PPO epochs over mini-batches (with ppo.overlap_update, some micro-batches ran during the rollout).
            m.update(self.update(exp) if batch.overlap is None else self.update(exp, batch.overlap))
        elif partial_enabled(self.ppo):  # partial rollouts: no group finished in this step
            log.info("step %d: no group finished its samples (ppo.partial_rollout); the update is skipped", step)
        else:  # dynamic sampling kept no group on some rank: nothing to learn from this step
            log.warning("step %d: no informative group to train on; the update is skipped", step)
        self.hook.rlcore_after_update(step=step, metrics=m)
        # 7. KL controller, metrics, checkpoint.
        if "kl/mean" in m:
            c.kl_ctrl.update(m["kl/mean"], len(scores))
        self.state.step, self.state.samples = step, self.state.samples + len(scores)
        reshard = c.reshard.stats()
        m.update(batch.reward_metrics, **self.rollout_metrics(rollout, batch.raw_scores), **reshard,
                 **self.source.metrics())
        m["time/reshard_s"] = reshard.get("reshard/to_gen_s", 0.0) + reshard.get("reshard/to_train_s", 0.0)
        m.update(self.clock.metrics())
        if self._last_save_s is not None:  # the save after the previous step (written after its metrics)
            m["time/checkpoint_s"], self._last_save_s = self._last_save_s, None
        m["time/step_s"] = time.perf_counter() - t0
        m.update(self.perf_metrics(rollout, m["time/step_s"]))
        m["actor/kl_coef"] = c.kl_ctrl.value
        self.hook.rlcore_step_end(step=step, metrics=m)
        if self.dist.distributed:  # averaged over ranks: what the log, the progress bar and the summary show
            m = all_reduce_mean(m)
        if step % self.tcfg.log_steps == 0 or step == self.tcfg.max_steps:
            self.hook.rlcore_metrics(step=step, metrics=m, split="train")
        if self.tcfg.eval_steps and step % self.tcfg.eval_steps == 0:
            self.evaluate("step")  # every rank takes part, also one without held-out rows
        # 8. Checkpoint, after the step's records: a crash in between never loses a step's metrics.
        if c.checkpoint.should_save(step):
            if self.may_save(step):
                t = time.perf_counter()
                c.checkpoint.save(step, self.stateful())
                self._last_save_s, self._saved_step = time.perf_counter() - t, step
            elif self.guard.streak == 0:
                raise TrainingError(f"the weights are not finite after step {step}: no checkpoint was written; "
                                    "the last checkpoint holds the last finite state")
        return m

    def save_last(self) -> None:
        """The checkpoint of the last step trained (completed or interrupted run), unless saved already;
        an asynchronous save lands before this returns."""
        c = self.c
        if c.checkpoint.should_save(self.state.step, final=True) and self.state.step != self._saved_step \
                and self.may_save(self.state.step):
            with self.timer("checkpoint"):
                c.checkpoint.save(self.state.step, self.stateful())
        c.checkpoint.wait()

    def report_ignored_settings(self) -> None:
        """After a resume, name the settings of this run that the checkpoint's state overrides
        (learning rate, weight decay, a fixed KL coefficient, the seed), so none is ignored silently."""
        c, notes = self.c, []
        for role, trained in (("actor", c.actor), ("critic", c.critic)):
            if trained is None or not trained.optimizer.param_groups:
                continue
            opt, sched = trained.optimizer, trained.scheduler
            group = opt.param_groups[0]
            saved_lr = float((getattr(sched, "base_lrs", None) or [group.get("initial_lr", group["lr"])])[0])
            if not math.isclose(saved_lr, float(self.cfg[role].lr), rel_tol=1e-9):
                notes.append(f"{role}.lr={float(self.cfg[role].lr):g} (the checkpoint's {saved_lr:g} continues)")
            if "weight_decay" in group and not math.isclose(float(group["weight_decay"]),
                                                            float(self.cfg[role].weight_decay), rel_tol=1e-9):
                notes.append(f"{role}.weight_decay={float(self.cfg[role].weight_decay):g} "
                             f"(the checkpoint's {float(group['weight_decay']):g} continues)")
        if self.ppo.kl_ctrl == "fixed" and not math.isclose(c.kl_ctrl.value, float(self.ppo.kl_coeff), rel_tol=1e-9):
            notes.append(f"ppo.kl_coeff={float(self.ppo.kl_coeff):g} (the checkpoint's {c.kl_ctrl.value:g} continues)")
        saved_seed = self.state.saved_seed
        if saved_seed is not None and saved_seed != int(self.tcfg.seed):
            notes.append(f"trainer.seed={int(self.tcfg.seed)} (the checkpoint's random streams of seed {saved_seed} "
                         "continue)")
        if notes:
            log.warning("resumed run: these settings differ from the checkpoint's and are ignored: %s. Set "
                        "trainer.resume=disable to start afresh with them", "; ".join(notes))

    def may_save(self, step: int) -> bool:
        """Whether the state after ``step`` may be saved: its last optimizer step was applied (not
        skipped as non-finite) and every weight is finite, so a save or the rotation that follows
        never replaces the last finite checkpoint."""
        if self.guard.streak:
            log.warning("step %d: no checkpoint while optimizer steps are being skipped as non-finite "
                        "(%d in a row)", step, self.guard.streak)
            return False
        if params_finite(self.c.policy, self.c.critic and self.c.critic.model):
            return True
        log.error("step %d: the weights are not finite: no checkpoint is written", step)
        return False

    # ------------------------------------------------------------------------------------------
    def timer(self, name: str):
        """Time ``name`` (``time/<name>_s``), marked ``rlcore.<name>`` in profiles (:class:`PhaseClock`)."""
        return self.clock.phase(name)

    def sampling(self, step: int, greedy: bool = False, round: int = 0) -> SamplingParams:
        """Sampling settings of ``step``; each extra rollout ``round`` of a step (dynamic sampling) has its own seed."""
        g = self.gen_cfg
        return SamplingParams(max_new_tokens=int(g.max_new_tokens), temperature=0.0 if greedy else float(g.temperature),
                              top_p=float(g.top_p), top_k=int(g.top_k),
                              seed=int(self.tcfg.seed) * 100003 + step * 101 + self.dist.rank + round * 1000003,
                              eos_token_ids=tuple(self.c.eos_ids), pad_token_id=int(self.c.tokenizer.pad_token_id))

    def expand(self, rows: list[dict], n: int | None = None) -> tuple[list[list[int]], dict[str, list]]:
        """Prompt ids and the other columns of ``rows`` (for the reward), each row repeated ``n`` times
        (default ``ppo.generation.n``)."""
        n = self.n if n is None else n
        prompts = [list(r["input_ids"]) for r in rows for _ in range(n)]
        cols = sorted({k for r in rows for k in r if k not in ("input_ids",)})
        extras = {k: [r.get(k) for r in rows for _ in range(n)] for k in cols}
        return prompts, extras

    def sample_round(self, rows: list[dict], step: int, round: int = 0) -> "Sampled":
        """Generate ``n`` responses for each of ``rows`` and score them (with overlong shaping, and
        the greedy baseline of ReMax)."""
        prompts, extras = self.expand(rows)
        # multi-turn rows play their episodes (data.env_key)
        prompts, episodes = self.start_episodes(rows, prompts)
        self.hook.rlcore_before_generation(step=step, prompts=prompts)
        # finished samples are scored while the rest decode (reward.stream), what is left once the rollout ends;
        # an episode's reward is known only once it ends, so episodes are scored after the rollout
        scorer = None if episodes else self.streaming_scorer(prompts, extras)
        # ppo.overlap_update: finished groups train while the rest decode (rlcore.trainer.overlap)
        overlap = overlap_update.start(self, scorer, prompts, episodes)
        pre, m_overlap = None, {}
        try:
            with self.timer("generate"), overlap.decoding() if overlap is not None else nullcontext():
                rollout = self.c.generation.generate(prompts, self.sampling(step, round=round),
                                                     on_finished=overlap or scorer)
            self.hook.rlcore_after_generation(step=step, rollout=rollout)
            episode_metrics = self.end_episodes(episodes, extras)
            with self.timer("reward"):
                raw, m_reward = scorer.finish(rollout) if scorer is not None else self.score(rollout, extras)
            if overlap is not None:
                pre, m_overlap = overlap.finish(rollout)
        finally:
            if overlap is not None:
                overlap.close()
            if scorer is not None:
                scorer.close()
        if scorer is not None:
            m_reward["reward/streamed_frac"] = scorer.streamed_frac
        scores, shaping = self.shape_scores(rollout, raw)
        m_reward.update(shaping, **episode_metrics)
        baseline = None
        if self.algo.adv_estimator == "remax":
            with self.timer("remax_baseline"):
                greedy_prompts, greedy_extras = self.expand(rows, n=1)
                greedy_prompts, greedy_episodes = self.start_episodes(rows, greedy_prompts, n=1)
                greedy = self.c.generation.generate(greedy_prompts, self.sampling(step, greedy=True, round=round))
                self.end_episodes(greedy_episodes, greedy_extras)
                b_raw, _ = self.score(greedy, greedy_extras)
                b_scores, _ = self.shape_scores(greedy, b_raw)
                baseline = b_scores.repeat_interleave(self.n)
        return Sampled(rollout=rollout, scores=scores, raw_scores=raw, reward_metrics=m_reward,
                       truncated=self.truncated(rollout), baseline=baseline,
                       group_ids=torch.arange(len(rows)).repeat_interleave(self.n), metrics=m_overlap, overlap=pre)

    def collect(self, step: int) -> "Sampled":
        """This step's scored samples. With ``algorithm.dynamic_sampling`` (DAPO), groups whose raw
        rewards are all equal are dropped and more prompts drawn (all ranks draw the same number of
        rounds, at most ``max_rounds`` extra) until ``ppo.rollout_batch_size`` groups are kept; every
        rank then keeps as many groups as the rank with the fewest, so the update's steps line up."""
        c = self.c
        ds = self.algo.dynamic_sampling
        rows = c.prompts.fill(c.prompts.loader.next_batch())
        first = self.sample_round(rows, step)
        if not ds.enable:
            return first
        target = int(c.prompts.fill.size)  # ppo.rollout_batch_size, resolved when "auto"
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
            rows = c.prompts.fill(c.prompts.loader.next_batch())
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

    def truncated(self, rollout: RolloutBatch, max_new_tokens: int | None = None) -> torch.Tensor:
        """``[B]`` bool: responses cut at ``max_new_tokens`` (default ``ppo.generation.max_new_tokens``)
        without an end-of-sequence token."""
        lengths = rollout.response_mask.sum(-1)
        ended = torch.zeros(rollout.response_ids.shape[0], dtype=torch.bool, device=rollout.response_ids.device)
        for e in self.c.eos_ids:
            ended |= ((rollout.response_ids == e) & rollout.response_mask.bool()).any(-1)
        cap = int(self.gen_cfg.max_new_tokens if max_new_tokens is None else max_new_tokens)
        return ((lengths >= cap) & ~ended).cpu()

    def _request(self, prompts: list[list[int]], extras: dict[str, list]) -> RolloutRequest:
        """The reward's view of the prompts: texts decoded from their tokens with
        ``skip_special_tokens=True``, as the responses are (see :class:`~rlcore.protocols.RewardInput`)."""
        distinct = list(dict.fromkeys(tuple(p) for p in prompts))  # a group's n samples share one prompt
        decoded = dict(zip(distinct, self.c.tokenizer.batch_decode([list(p) for p in distinct],
                                                                    skip_special_tokens=True)))
        return RolloutRequest([decoded[tuple(p)] for p in prompts], prompts, dict(extras))

    def streaming_scorer(self, prompts: list[list[int]], extras: dict[str, list]) -> Optional[StreamingScorer]:
        """A scorer that takes finished samples during the rollout, where ``reward.stream`` is on and
        can be: one process (a distributed reward is a collective every rank calls once) and no
        reward model (GPU work beside the rollout). None: score after the rollout."""
        if not self.cfg.reward.stream or self.dist.world_size > 1 or self.cfg.reward_model.enable:
            return None
        return StreamingScorer(self.c.reward, self.c.tokenizer, self._request(prompts, extras),
                               plugin=self.plugin_of("reward"))

    def start_episodes(self, rows: list[dict], prompts: list[list[int]], n: int | None = None) -> tuple[list, list]:
        """With ``data.env_key``: start an episode per sample (``n`` a row, default ``ppo.generation.n``)
        whose row names an environment; its prompt then carries it (and becomes the environment's
        initial messages if it gives some)."""
        if self.episodes is None:
            return prompts, []
        from rlcore.envs.runner import EpisodePrompt

        key = self.cfg.data.env_key
        n = self.n if n is None else n
        samples = [r for r in rows for _ in range(n)]
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

    def score(self, rollout: RolloutBatch, extras: dict[str, list]) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores of ``rollout``, in one reward call. Prompt and response texts are decoded alike, from
        their tokens with ``skip_special_tokens=True`` (see :class:`~rlcore.protocols.RewardInput`)."""
        prompts = _rows(rollout.prompt_ids, rollout.prompt_mask)
        return score_rollout(self.c.reward, self.c.tokenizer, self._request(prompts, extras), rollout,
                             plugin=self.plugin_of("reward"))

    def make_experience(self, rollout: RolloutBatch, scores: torch.Tensor) -> Experience:
        c = self.c
        exp = to_experience(rollout, scores, c.train_device)
        micro = c.micro_batch
        temp = float(self.gen_cfg.temperature)
        max_tokens = int(self.ppo.max_tokens_per_micro_batch)
        # cut each chunk to its used columns (a token budget and packing read the response mask too)
        trim = exp.response_mask if (self.ppo.trim_padding or c.packed or max_tokens > 0) else None
        cut = dict(max_tokens=max_tokens, packed=c.packed)
        # one optimizer step over the rollout: the update's forward gives the old log-probs
        own_old = c.ref is None and on_policy(exp.size, self.ppo, int(self.tcfg.gradient_accumulation_steps))
        if trim is not None and not (own_old and c.critic is None):
            cut["sizes"] = host_sizes(exp)  # read once: the passes' chunks shaped on the host
        c.policy.eval()
        if own_old:
            exp.old_logprobs = None
        else:
            with self.timer("old_logprob"):
                exp.old_logprobs = batched_logprobs(c.actor.model, exp.input_ids, exp.attention_mask,
                                                    exp.response_len, temp, micro, trim, **cut)
        if c.ref is not None:
            with self.timer("ref_logprob"):
                exp.ref_logprobs = batched_logprobs(c.ref, exp.input_ids, exp.attention_mask, exp.response_len,
                                                    temp, micro, trim, **cut)
        if c.critic is not None:
            with self.timer("values"):
                exp.values = batched_values(c.critic.model, exp.input_ids, exp.attention_mask, exp.response_len,
                                            micro, trim, **cut)
        return exp

    def experience(self, batch: "Sampled", timed: bool = True) -> tuple[Experience, dict[str, float]]:
        """Steps 4-5 for ``batch``: its training rows with old and reference log-probs and values where the
        update needs them, then its advantages (timed as ``advantages``: ``timed``); and their metrics."""
        exp = self.make_experience(batch.rollout, batch.scores)
        exp.group_ids, exp.baseline = batch.group_ids.to(exp.scores.device), batch.baseline
        if self.algo.mask_truncated:
            exp.loss_mask = (~batch.truncated).float().to(exp.scores.device)
        with self.timer("advantages") if timed else nullcontext():
            metrics = compute_advantages(exp, self.algo, self.ppo, self.c.kl_ctrl.value, self.n)
        return exp, metrics

    def update(self, exp: Experience, pre: Optional[Accumulated] = None) -> dict[str, float]:
        """Step 6: the PPO update of ``exp``; ``pre``: its micro-batches trained during the rollout."""
        from rlcore.observe.compile_stats import reading

        c = self.c
        kl_loss_coef = 0.0 if self.ppo.kl_in_reward else c.kl_ctrl.value
        critic = c.critic
        compiled_before = reading()
        with self.clock.phase("update", timed=False):  # its seconds: time/update_actor_s, ...
            out = ppo_update(exp, actor=c.actor.model, actor_opt=c.actor.optimizer, actor_sched=c.actor.scheduler,
                             actor_grad_clip=self.cfg.actor.grad_clip, critic=critic and critic.model,
                             critic_opt=critic and critic.optimizer, critic_sched=critic and critic.scheduler,
                             critic_grad_clip=self.cfg.critic.grad_clip, ppo=self.ppo,
                             grad_accum=int(self.tcfg.gradient_accumulation_steps),
                             temperature=float(self.gen_cfg.temperature) or 1.0, kl_loss_coef=kl_loss_coef,
                             generator=self._gen, packed=c.packed, recompute=c.recompute, guard=self.guard, pre=pre)
        for policy in c.recompute.values():
            out.update(policy.take_metrics())
        # compilation inside the update (new lengths for the compiled layers): the host works, the device waits
        out.update(reading().since(compiled_before, "update"))
        if self.ppo.overlap_update:  # 0 also where the step could not overlap (the reason was logged)
            out["update/overlapped_frac"] = len(pre.done) / max(1, exp.size) if pre is not None else 0.0
        return out

    def perf_metrics(self, rollout: RolloutBatch, step_s: float) -> dict[str, float]:
        return self.perf.metrics(rollout.prompt_mask, rollout.response_mask, step_s)

    def progress(self, start: int) -> ProgressBar:
        """The progress bar (main rank, ``trainer.progress``); closes on exit."""
        return ProgressBar(start, int(self.tcfg.max_steps), enabled=bool(self.tcfg.progress) and self.dist.is_main)

    def rollout_metrics(self, rollout: RolloutBatch, scores: torch.Tensor) -> dict[str, float]:
        if not len(scores):
            return {}
        lengths = rollout.response_mask.sum(-1).float()
        return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
                "reward/min": float(scores.min()), "reward/max": float(scores.max()),
                "response/length_mean": float(lengths.mean()), "response/length_max": float(lengths.max()),
                "response/clip_frac": float(self.truncated(rollout).float().mean()),
                # samples the engine's paged KV cache had to preempt (and sample again) for want of pages;
                # multi-turn rollouts: observation tokens, waits of the engine for an environment's answer;
                # the decode steps, and those of the tail (a batch of at most 8 rows) with their seconds
                **{key: float(rollout.stats[key]) for key in ("rollout/preemptions", "rollout/kv_bytes_peak",
                                                              "rollout/observation_tokens", "rollout/env_waits",
                                                              "rollout/decode_steps", "rollout/tail_steps",
                                                              "rollout/tail_s", "rollout/kv_released_bytes",
                                                              "rollout/kv_acquire_s")
                   if key in rollout.stats},
                # the engine's host seconds by part of its loop and its device reads (rollout/host_syncs)
                **{key: float(value) for key, value in rollout.stats.items() if key.startswith("rollout/host_")}}

    @torch.no_grad()
    def evaluate(self, tag: str) -> dict[str, float]:
        """The held-out prompts scored with the ``eval`` settings (default: one greedy sample each), over
        every rank's prompts (:mod:`rlcore.trainer.evaluation`, as ``rlcore eval`` does); logged under ``val``."""
        from rlcore.trainer.evaluation import eval_sampling, sample_and_score, summarize, val_metrics

        ev = self.cfg.eval
        results = sample_and_score(self, self.c.prompts.val_rows, int(ev.n),
                                   eval_sampling(ev, self.gen_cfg, self.sampling(0, greedy=True)),
                                   int(self.gen_cfg.batch_size))
        out = val_metrics(summarize(results, int(ev.n), float(ev.pass_threshold)))
        if out:
            self.hook.rlcore_metrics(step=self.state.step, metrics=dict(out), split="val")
        return out
