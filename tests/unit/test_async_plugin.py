"""The ``async`` plugin's parts in one process: settings, the bridge (gloo groups in threads), weights
in buckets, and the rollout source's order of work with stand-in peers."""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist

from rlcore.distributed.split import Bridge, BridgeError
from rlcore.errors import ConfigError, PlacementError
from rlcore.plugins import async_rl


def _configured(section: dict) -> async_rl.AsyncSettings:
    from rlcore.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(["async"])
    pm.configure({"async": section})
    return pm.settings_of("async")


def test_settings_are_checked_and_unknown_keys_named():
    assert _configured({}) == async_rl.AsyncSettings()
    assert _configured({"max_staleness": 2}).max_staleness == 2
    with pytest.raises(ConfigError, match=r"'plugin_config.async.max_stalenes': plugin 'async' has no such setting "
                                          r"\(did you mean 'max_staleness'\?\)"):
        _configured({"max_stalenes": 2})
    with pytest.raises(ConfigError, match=r"'plugin_config.async.max_staleness' = -1 must be an integer >= 0"):
        async_rl.check_settings(_configured({"max_staleness": -1}))
    with pytest.raises(ConfigError, match=r"'plugin_config.async.weights_backend' = 'mpi' must be auto, gloo or nccl"):
        async_rl.check_settings(_configured({"weights_backend": "mpi"}))


@pytest.mark.parametrize("world,settings,expected", [(4, {}, 1), (8, {}, 2), (3, {"rollout_ranks": 2}, 2),
                                                     (10, {"rollout_fraction": 0.5}, 5)])
def test_rollout_rank_count(world, settings, expected):
    assert async_rl.rollout_rank_count(world, async_rl.AsyncSettings(**settings)) == expected


def test_rollout_rank_count_refuses_a_split_without_trainers_or_processes():
    with pytest.raises(PlacementError, match="start at least 2 processes"):
        async_rl.rollout_rank_count(1, async_rl.AsyncSettings())
    with pytest.raises(PlacementError, match="leaves no training rank in a job of 2"):
        async_rl.rollout_rank_count(2, async_rl.AsyncSettings(rollout_ranks=2))


def test_buckets_keep_order_split_by_size_and_dtype():
    items = [("a", torch.zeros(10)), ("b", torch.zeros(10)), ("c", torch.zeros(30)), ("d", torch.zeros(5, dtype=torch.int64)),
             ("e", torch.zeros(2))]
    plan = async_rl.plan_buckets(items, bucket_bytes=100)  # 25 floats a bucket
    assert plan == [("float32", [("a", (10,)), ("b", (10,))]), ("float32", [("c", (30,))]),
                    ("int64", [("d", (5,))]), ("float32", [("e", (2,))])]


def _bridges(size: int, timeout_s: float = 20.0) -> list[Bridge]:
    store = tdist.HashStore()
    groups: list = [None] * size

    def make(rank):
        groups[rank] = tdist.ProcessGroupGloo(tdist.PrefixStore("b/", store), rank, size, timedelta(seconds=timeout_s))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    names = ["training rank 0"] + [f"rollout rank {i}" for i in range(size - 1)]
    return [Bridge(g, r, size, names) for r, g in enumerate(groups)]


def test_bridge_objects_and_weights_reach_the_rollout_model():
    """Training rank 0 sends an object and a model's weights (several buckets, tied and buffer
    tensors among them); the rollout side's empty model then equals the trainer's."""
    from rlcore.rollout.tiny import tiny_causal_lm

    trainer_model = tiny_causal_lm("qwen2")
    rollout_model = tiny_causal_lm("qwen2")
    with torch.no_grad():
        for p in rollout_model.parameters():
            p.zero_()
    a, b = _bridges(2)
    items = async_rl.full_weights(trainer_model)
    got = {}

    def rollout_side():
        msg = b.recv(0)
        got["msg"] = msg
        async_rl.load_buckets(msg[2], async_rl.receive_buckets(b, msg[2]), rollout_model)

    th = threading.Thread(target=rollout_side)
    th.start()
    seconds = async_rl.send_weights(a, items, version=3, bucket_bytes=4096)
    th.join(30)
    assert got["msg"][0] == "weights" and got["msg"][1] == 3 and len(got["msg"][2]) > 2 and seconds >= 0
    for (name, want), (_, have) in zip(trainer_model.state_dict().items(), rollout_model.state_dict().items()):
        assert torch.equal(want, have), name
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.equal(trainer_model(ids).logits, rollout_model(ids).logits)


def test_a_dead_peer_is_an_error_naming_it():
    a, _ = _bridges(2, timeout_s=1.0)
    with pytest.raises(BridgeError, match="waiting for rollout rank 0 failed"):
        a.recv(1)


def test_stale_samples_need_the_rollout_importance_weight():
    with pytest.raises(ConfigError, match=r"set 'ppo.rollout_is' to token or sequence"):
        async_rl.check_run({"ppo": {"rollout_is": "none"}}, async_rl.AsyncSettings(max_staleness=1))
    async_rl.check_run({"ppo": {"rollout_is": "none"}}, async_rl.AsyncSettings(max_staleness=0))
    async_rl.check_run({"ppo": {"rollout_is": "token"}}, async_rl.AsyncSettings(max_staleness=2))
    with pytest.raises(ConfigError) as error:
        async_rl.check_run({"ppo": {"rollout_is": "token"}, "algorithm": {"adv_estimator": "remax",
                            "dynamic_sampling": {"enable": True}}, "data": {"env_key": "env"}}, async_rl.AsyncSettings())
    assert [p.split(" (")[0] for p in error.value.problems] == [
        "plugin 'async' does not run algorithm.adv_estimator=remax", "plugin 'async' does not run "
        "algorithm.dynamic_sampling", "plugin 'async' does not play multi-turn episodes"]


@pytest.mark.parametrize("overrides,message", [
    ([], "plugin 'async' runs generation and training on separate ranks: start at least 2 processes"),
    (["trainer.nproc_per_node=2", "plugin_config.async.rollout_ranks=2"],
     "'plugin_config.async.rollout_ranks' = 2 leaves no training rank in a job of 2 processes"),
    (["plugin_config.async.max_staleness=0", "plugin_config.async.bucket_mb=0"],
     "'plugin_config.async.bucket_mb' = 0 must be an integer >= 1"),
])
def test_rlcore_train_refuses_bad_async_settings_before_any_process_starts(tmp_path, capsys, monkeypatch, overrides,
                                                                            message):
    """One process, or a split without trainers, fails with exit status 2 and names the setting; no
    worker is launched and no model is built."""
    from rlcore import cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = cli.main(["train", "--plugins", "async", "trainer.device=cpu", "ppo.rollout_is=token",
                     f"trainer.output_dir={tmp_path / 'run'}", *overrides])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_rlcore_world_split_is_answered_by_async_when_selected_else_by_the_default():
    from rlcore.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(["async"])
    pm.configure({"async": {"rollout_fraction": 0.5}})
    split = pm.build("rlcore_world_split", world_size=4, config={})
    assert isinstance(split, async_rl.AsyncSplit) and split.rollout_ranks == 2 and split.weights_backend == "auto"
    whole = build_plugin_manager([]).build("rlcore_world_split", world_size=4, config={})
    assert whole.rollout_ranks == 0


def test_a_training_ranks_rows_keep_every_per_sample_tensor():
    from rlcore.rollout.base import RolloutBatch

    ids = torch.arange(12).view(4, 3)
    batch = RolloutBatch(ids, torch.ones(4, 3), ids + 100, torch.ones(4, 3), torch.zeros(4, 3), stats={"x": 1.0},
                         response_attention=torch.arange(12).view(4, 3) % 2)
    part = async_rl._take(batch, 1, 3)
    assert torch.equal(part.prompt_ids, ids[1:3]) and torch.equal(part.response_ids, ids[1:3] + 100)
    assert torch.equal(part.response_attention, batch.response_attention[1:3]) and part.stats == {"x": 1.0}
    assert async_rl._take(dataclasses.replace(batch, response_attention=None), 0, 2).response_attention is None
