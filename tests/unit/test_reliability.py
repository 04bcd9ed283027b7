"""Issue 21 (Reliability II): no silent loss, no NaN saved as success, no code run from a checkpoint.

Each test fails on the code before the fix: a crafted checkpoint ran code, a pointer led out of the
run, a kill mid-delete left a half checkpoint, a torn metrics line swallowed the next record, the
demo build was not atomic, shards were cast into the first one's schema, errors were tracebacks or
named the wrong row, rewards hung or gave up silently.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlcore.config.schema import DataConfig, PPOConfig, RewardConfig, RewardFunctionConfig, TrainerConfig
from rlcore.errors import CheckpointError, ConfigError, DataError, RewardError
from rlcore.protocols import DistInfo
from rlcore.trainer.checkpoint import DefaultCheckpointPolicy, list_checkpoints


class Counter:
    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self):
        return {"value": self.value, "weights": torch.arange(4.0) * self.value}

    def load_state_dict(self, state):
        self.value = int(state["value"])


def _policy(root: Path, **kw) -> DefaultCheckpointPolicy:
    return DefaultCheckpointPolicy(TrainerConfig(output_dir=str(root), resume="auto", **kw), DistInfo())


def _save(root: Path, *steps: int, **kw) -> DefaultCheckpointPolicy:
    policy = _policy(root, **kw)
    for step in steps:
        policy.save(step, {"trainer": Counter(step)})
    return policy


def _rehash(ckpt: Path) -> None:
    """Update the manifest's sizes and checksums, as an attacker would."""
    import hashlib

    manifest = json.loads((ckpt / "manifest.json").read_text())
    for rel in manifest["files"]:
        data = (ckpt / rel).read_bytes()
        manifest["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


class _Payload:
    """Pickles as a call that creates a file: what a crafted checkpoint would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


# ---------------------------------------------------------------------------------------------
# Checkpoints are data
# ---------------------------------------------------------------------------------------------


def test_a_crafted_state_file_runs_no_code(tmp_path):
    _save(tmp_path, 1)
    ckpt = tmp_path / "checkpoints" / "step_00000001"
    marker = tmp_path / "code-ran"
    torch.save({"trainer": {"value": 1, "evil": _Payload(marker)}}, ckpt / "state" / "rank_00000.pt")
    _rehash(ckpt)
    with pytest.raises(CheckpointError, match="objects other than data"):
        _policy(tmp_path).resume({"trainer": Counter()})
    assert not marker.exists()


def test_crafted_dcp_metadata_runs_no_code(tmp_path):
    from rlcore.trainer.store import manifest as mf
    from rlcore.trainer.store import state as stored

    def state():
        model = torch.nn.Linear(3, 2)
        return {"actor": model, "actor_optim": torch.optim.AdamW(model.parameters())}

    ckpt = tmp_path / "step_00000001"
    stored.write_state(ckpt, state(), "dcp", DistInfo(), asynchronous=False, on_done=lambda: None)
    mf.write_manifest(ckpt, step=1, world_size=1, fmt="dcp", kinds={"actor": "model", "actor_optim": "optim"})
    stored.load_state(ckpt, mf.read_manifest(ckpt), state(), DistInfo(), seed=0)  # genuine metadata loads
    marker = tmp_path / "code-ran"
    import pickle

    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match="objects other than data"):
        stored.load_state(ckpt, mf.read_manifest(ckpt), state(), DistInfo(), seed=0)
    assert not marker.exists()


def test_resume_never_follows_a_pointer_out_of_the_run(tmp_path, caplog):
    _save(tmp_path / "other", 5)
    _save(tmp_path / "run", 1)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("../../other/checkpoints/step_00000005\n")
    counter = Counter()
    with caplog.at_level(logging.WARNING):
        assert _policy(tmp_path / "run").resume({"trainer": counter}) == 1
    assert counter.value == 1 and "not a checkpoint inside" in caplog.text
    with pytest.raises(CheckpointError, match="refusing to follow it"):
        DefaultCheckpointPolicy(TrainerConfig(output_dir=str(tmp_path / "x"), resume=str(tmp_path / "run")),
                                DistInfo()).resume({"trainer": Counter()})


def test_a_manifest_entry_outside_the_checkpoint_makes_it_unusable(tmp_path):
    from rlcore.trainer.store.manifest import verify

    _save(tmp_path, 1)
    ckpt = tmp_path / "checkpoints" / "step_00000001"
    (tmp_path / "secret").write_text("x")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["../../secret"] = {"bytes": 1, "sha256": "0" * 64}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert any("outside the checkpoint directory" in p for p in verify(ckpt))


def test_a_kill_while_rotating_leaves_no_half_deleted_checkpoint(tmp_path, monkeypatch):
    real_rmtree = shutil.rmtree

    def killed_midway(path, *a, **kw):  # deletes the data files, then the process dies
        for f in sorted(Path(path).rglob("*.pt")):
            f.unlink()
        raise SystemExit("killed")

    policy = _save(tmp_path, 1, 2, save_total_limit=2)
    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(SystemExit):
        policy.save(3, {"trainer": Counter(3)})  # rotation deletes step 1
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    from rlcore.trainer.store.manifest import verify

    for ckpt in list_checkpoints(tmp_path / "checkpoints"):
        assert verify(ckpt) == [], f"{ckpt.name} is half deleted"
    assert _policy(tmp_path).resume({"trainer": Counter()}) == 3


def test_a_full_disk_is_one_clear_line(tmp_path, monkeypatch):
    from rlcore.trainer.store import files

    def full(obj, f, *a, **kw):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0\n" + "frame\n" * 40)

    monkeypatch.setattr(torch, "save", full)
    monkeypatch.setattr(files, "free_bytes", lambda path: 0)
    with pytest.raises(CheckpointError) as err:
        _save(tmp_path, 1)
    assert "no space left on the device" in str(err.value) and len(str(err.value).splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# Non-finite training
# ---------------------------------------------------------------------------------------------


def test_non_finite_optimizer_steps_are_skipped_then_stop_the_run():
    from rlcore.errors import TrainingError
    from rlcore.rollout.tiny import tiny_causal_lm
    from rlcore.trainer.experience import Experience
    from rlcore.trainer.update import NonFiniteGuard, ppo_update

    model = tiny_causal_lm("qwen2")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (4, 8), generator=g)
    adv = torch.randn(4, 4, generator=g)
    adv[2, 1] = float("nan")  # e.g. a reward of 3e38 overflowing the group normalization
    exp = Experience(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(4, 4),
                     old_logprobs=None, scores=torch.zeros(4), advantages=adv)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    guard = NonFiniteGuard(limit=1)
    kw = dict(actor=model, actor_opt=opt, actor_sched=sched, actor_grad_clip=1.0, ppo=PPOConfig(), grad_accum=1,
              temperature=1.0, kl_loss_coef=0.0, guard=guard)
    out = ppo_update(exp, **kw)
    assert out["train/nonfinite_steps"] == 1 and out["actor/optimizer_steps"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the step was skipped
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TrainingError, match="trainer.max_nonfinite_steps=1"):
        ppo_update(exp, **kw)
    assert all(torch.isfinite(p).all() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# Config checks at load time
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, key", [
    ("ppo.cliprange=-1", "ppo.cliprange"), ("ppo.dual_clip=0.5", "ppo.dual_clip"),
    ("ppo.cliprange_value=-0.1", "ppo.cliprange_value"), ("algorithm.gamma=1.5", "algorithm.gamma"),
    ("algorithm.lam=-0.1", "algorithm.lam"), ("ppo.vf_coef=-1", "ppo.vf_coef"),
    ("trainer.eval_samples=-1", "trainer.eval_samples"), ("reward.timeout_s=0", "reward.timeout_s"),
    ("ppo.mini_batch_size=33", "ppo.mini_batch_size"),
])
def test_bad_rl_settings_fail_at_config_load(override, key):
    from rlcore.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config([], ["ppo.rollout_batch_size=32", "ppo.generation.n=2", override])
    assert f"'{key}'" in str(err.value) and len(str(err.value).splitlines()) == 2


def test_mini_batches_that_would_drop_samples_are_refused_at_run_time_too():
    from rlcore.trainer.update import Batching

    assert Batching.from_config(64, PPOConfig(mini_batch_size=32), 1).mini == 32
    with pytest.raises(ConfigError, match="31 samples per epoch would never be trained on"):
        Batching.from_config(64, PPOConfig(mini_batch_size=33), 1)


def test_temperature_zero_with_group_advantages_warns():
    from rlcore.config import load_config
    from rlcore.config.loader import config_warnings

    cfg = load_config([], ["algorithm.adv_estimator=grpo", "ppo.generation.n=4", "ppo.generation.temperature=0"])
    assert any("every group advantage is zero" in w for w in config_warnings(cfg))
    assert config_warnings(load_config([], ["algorithm.adv_estimator=grpo", "ppo.generation.n=4"])) == []


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


def test_a_torn_metrics_line_does_not_corrupt_the_next_record(tmp_path):
    from rlcore.observe.jsonl import JsonlWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "split": "train"}\n{"step": 2, "spl')  # killed mid-write
    writer = JsonlWriter(str(path))
    writer.write({"step": 2, "split": "train"})
    writer.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_kill_during_the_demo_model_build_leaves_nothing_half_built(tmp_path, monkeypatch):
    from rlcore import demo

    real = demo.build_model_dir

    def killed_after_config(save_dir, **kw):
        real(save_dir, **kw)
        os.remove(os.path.join(save_dir, "model.safetensors"))
        raise SystemExit("killed")

    monkeypatch.setattr(demo, "build_model_dir", killed_after_config)
    with pytest.raises(SystemExit):
        demo.ensure_demo_model(str(tmp_path))
    monkeypatch.setattr(demo, "build_model_dir", real)
    path = demo.ensure_demo_model(str(tmp_path))
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(path).config.num_hidden_layers >= 1


# ---------------------------------------------------------------------------------------------
# Data: shards, encodings, row numbers, every line
# ---------------------------------------------------------------------------------------------


def _write(path: Path, rows: list[dict]) -> str:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), str(path))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(dataset) -> list[dict]:
    return [dataset[i] for i in range(len(dataset))]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
@pytest.mark.parametrize("cached", [False, True])
def test_shards_keep_every_column_and_refuse_lossy_casts(tmp_path, tiny_tokenizer, suffix, cached):
    from rlcore.data.provider import build_dataset

    a = _write(tmp_path / f"a{suffix}", [{"prompt": "a b", "ground_truth": 7}])
    b = _write(tmp_path / f"b{suffix}", [{"prompt": "c d", "ground_truth": 8, "hint": "x"}])
    c = _write(tmp_path / f"c{suffix}", [{"prompt": "e f", "ground_truth": "007"}])
    cfg = dict(cache_dir=str(tmp_path / "cache") if cached else None)
    rows = _rows(build_dataset(DataConfig(train_files=[a, b], **cfg), tiny_tokenizer, "train", DistInfo()))
    assert [(r["ground_truth"], r["hint"]) for r in rows] == [(7, None), (8, "x")]
    with pytest.raises(DataError) as err:
        build_dataset(DataConfig(train_files=[a, c], **cfg), tiny_tokenizer, "train", DistInfo())
    msg = str(err.value)
    assert "'ground_truth'" in msg and f"a{suffix}" in msg and f"c{suffix}" in msg


def test_streaming_shards_keep_every_column_and_refuse_lossy_casts(tmp_path, tiny_tokenizer):
    from rlcore.data.streaming import build_streaming_dataset

    a = _write(tmp_path / "a.parquet", [{"prompt": "a b", "ground_truth": 7}])
    b = _write(tmp_path / "b.parquet", [{"prompt": "c d", "ground_truth": 8, "hint": "x"}])
    c = _write(tmp_path / "c.parquet", [{"prompt": "e f", "ground_truth": "007"}])
    ds = build_streaming_dataset(DataConfig(train_files=[a, b], shuffle=False), tiny_tokenizer, "train", DistInfo())
    rows = sorted(ds, key=lambda r: r["prompt"])
    assert [(r["ground_truth"], r["hint"]) for r in rows] == [(7, None), (8, "x")]
    with pytest.raises(DataError, match=r"'ground_truth' is int64 in .*a\.parquet but string in .*c\.parquet"):
        build_streaming_dataset(DataConfig(train_files=[a, c]), tiny_tokenizer, "train", DistInfo())


def test_streaming_reports_dropped_prompts_at_once(tmp_path, tiny_tokenizer, caplog):
    from rlcore.data.streaming import build_streaming_dataset

    rows = [{"prompt": " ".join("abcdefgh")}] + [{"prompt": "a b"}] * 3000
    path = _write(tmp_path / "a.parquet", rows)
    ds = build_streaming_dataset(DataConfig(train_files=[path], shuffle=False, max_prompt_length=4),
                                 tiny_tokenizer, "train", DistInfo())
    with caplog.at_level(logging.WARNING):
        next(iter(ds))  # the slice is far from its end
    assert "dropping prompts over data.max_prompt_length=4" in caplog.text


def test_text_that_is_not_utf8_names_file_row_and_column(tmp_path, tiny_tokenizer):
    from rlcore.data.provider import build_dataset, check_data_files

    jl = tmp_path / "bad.jsonl"
    jl.write_bytes(b'{"prompt": "a b"}\n{"prompt": "a b", "ground_truth": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2 is not valid UTF-8"):
        check_data_files(DataConfig(train_files=[str(jl)]))
    raw = pa.array([b"x", b"\xff"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"prompt": ["a b", "c d"], "ground_truth": raw}), str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError, match=r"bad\.parquet: row 1, column 'ground_truth': the text is not valid UTF-8"):
        build_dataset(DataConfig(train_files=[str(tmp_path / "bad.parquet")]), tiny_tokenizer, "train", DistInfo())


def test_errors_name_the_row_of_the_file_not_of_a_read_batch(tmp_path, tiny_tokenizer):
    from rlcore.data.provider import build_dataset

    path = _write(tmp_path / "a.jsonl", [{"prompt": "a b"}] * 4500 + [{"prompt": ""}])
    with pytest.raises(DataError, match=r"first at row 4500\b"):
        build_dataset(DataConfig(train_files=[path]), tiny_tokenizer, "train", DistInfo())


def test_validate_reads_every_jsonl_line(tmp_path):
    from rlcore.data.provider import check_data_files

    jl = tmp_path / "a.jsonl"
    jl.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"\n')
    with pytest.raises(DataError, match=r"a\.jsonl line 3 is not valid JSON"):
        check_data_files(DataConfig(train_files=[str(jl)]))


# ---------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------


def _batch(n: int, first: int = 0):
    from rlcore.protocols import RewardInput

    return RewardInput(prompts=[f"q{i}" for i in range(n)], responses=[f"r{i + first}" for i in range(n)],
                       prompt_ids=[[1]] * n, response_ids=[[2]] * n, extras={})


def _backend(tmp_path, source: str, **reward):
    from rlcore.rewards.backend import assemble_backend

    path = tmp_path / "fn.py"
    path.write_text(source)
    return assemble_backend(RewardFunctionConfig(path=str(path), name="score"), RewardConfig(**reward), {})


def test_the_timeout_holds_in_process(tmp_path):
    src = "import time\ndef score(response):\n    if response == 'r1':\n        time.sleep(30)\n    return 1.0\n"
    backend = _backend(tmp_path, src, timeout_s=0.2, fallback_score=0.0, max_fallback_share=1.0)
    t = time.monotonic()
    out = backend.score(_batch(3))
    assert time.monotonic() - t < 5
    assert out.scores.tolist() == [1.0, 0.0, 1.0] and out.metrics["reward/errors"] == 1
    backend = _backend(tmp_path, src, timeout_s=0.2)
    with pytest.raises(RewardError, match=r"failed on sample 1: no result within reward.timeout_s=0.2 s"):
        backend.score(_batch(3))


def test_a_function_that_needs_the_main_thread_still_runs(tmp_path, caplog):
    src = ("import signal\ndef score(response):\n    signal.signal(signal.SIGALRM, signal.getsignal(signal.SIGALRM))\n"
           "    return 1.0\n")
    with caplog.at_level(logging.WARNING):
        assert _backend(tmp_path, src).score(_batch(2)).scores.tolist() == [1.0, 1.0]
    assert "needs the main thread" in caplog.text


def test_none_is_an_error_naming_the_sample(tmp_path):
    src = "def score(response):\n    if response != 'r2':\n        return 1.0\n"
    for fallback in (None, 0.0):
        with pytest.raises(RewardError, match=r"returned None for sample 2 instead of a score"):
            _backend(tmp_path, src, fallback_score=fallback).score(_batch(3))


def test_a_fallback_that_dominates_warns_then_stops(tmp_path, caplog):
    src = "def score(response):\n    if response != 'r0':\n        raise ValueError('unparsable')\n    return 1.0\n"
    with caplog.at_level(logging.WARNING):
        out = _backend(tmp_path, src, fallback_score=0.0, max_fallback_share=1.0).score(_batch(4))
    assert out.metrics["reward/errors"] == 3 and "failed on 3 of 4 samples" in caplog.text
    with pytest.raises(RewardError, match=r"more than reward.max_fallback_share=0.5"):
        _backend(tmp_path, src, fallback_score=0.0, max_fallback_share=0.5).score(_batch(4))


def test_a_crashed_reward_worker_reports_how_it_ended(tmp_path):
    src = ("import os, signal\ndef score(response):\n    if response == 'r0':\n        os._exit(3)\n"
           "    os.kill(os.getpid(), signal.SIGKILL)\n")
    backend = _backend(tmp_path, src, num_workers=1, fallback_score=None)
    try:
        with pytest.raises(RewardError, match=r"the worker process died \(exit code 3\)"):
            backend.score(_batch(1))
        with pytest.raises(RewardError, match=r"the worker process died \(killed by SIGKILL"):
            backend.score(_batch(1, first=1))
    finally:
        backend.close()
