"""Placement policy: colocated by default, split rank pools validated against the world size."""

from __future__ import annotations

import pytest
import torch

from rlcore.distributed.placement import ColocatedPlacement, check_rank_groups, parse_device
from rlcore.errors import PlacementError
from rlcore.protocols import DistInfo, PlacementPolicy, PlacementRequest


def policy(groups=None, rank=0, world=4, **devices):
    return ColocatedPlacement(PlacementRequest(rank_groups=groups or {}, **devices),
                              DistInfo(rank=rank, world_size=world))


def test_colocated_by_default():
    p = policy()
    assert isinstance(p, PlacementPolicy)
    assert not p.split
    for role in ("actor", "critic", "ref", "reward"):
        assert p.ranks_for(role) == [0, 1, 2, 3]
        assert p.device_for(role) == torch.device("cpu")
        assert p.holds(role)
    assert p.process_group("actor") is None


def test_split_pools_per_rank():
    groups = {"actor": [0, 1, 2], "critic": [2, 1, 0], "reward": [3]}
    on_reward_rank, on_actor_rank = policy(groups, rank=3), policy(groups, rank=1)
    assert on_reward_rank.split
    assert on_reward_rank.ranks_for("critic") == [0, 1, 2]
    assert on_reward_rank.ranks_for("ref") == [0, 1, 2, 3]  # not named: every rank
    assert on_reward_rank.holds("reward") and not on_reward_rank.holds("actor")
    assert on_actor_rank.holds("actor") and not on_actor_rank.holds("reward")
    assert on_reward_rank.device_for("reward") == torch.device("cpu")
    with pytest.raises(PlacementError, match="role 'actor' is not placed on rank 3"):
        on_reward_rank.device_for("actor")
    assert on_actor_rank.describe()["reward"] == [3]


@pytest.mark.parametrize("groups, message", [
    ({"reward": [4]}, r"role 'reward' placed on ranks \[4\], but the world size is 4"),
    ({"reward": [-1]}, r"ranks \[-1\]"),
    ({"actor": []}, "empty rank group"),
    ({"actor": [0, 0, 1]}, "repeats a rank"),
    ({"policy": [0]}, "unknown role 'policy'"),
    ({"actor": "0,1"}, "must be a list of ranks"),
    ({"actor": [0.5]}, "ranks must be integers"),
    ({"actor": [0], "critic": [0], "ref": [0], "reward": [1]}, r"rank\(s\) \[2, 3\] hold no role"),
])
def test_invalid_pools_are_clear_errors(groups, message):
    with pytest.raises(PlacementError, match=message):
        policy(groups)


def test_every_problem_reported_at_once():
    with pytest.raises(PlacementError) as info:
        check_rank_groups({"actor": [9], "judge": [0], "critic": []}, 2)
    text = str(info.value)
    assert "ranks [9]" in text and "unknown role 'judge'" in text and "empty rank group" in text


def test_unknown_role_and_offload():
    p = policy(reward_offload=True)
    assert p.offload("reward") and not p.offload("actor")
    with pytest.raises(PlacementError, match="unknown role 'judge'"):
        p.ranks_for("judge")


def test_device_strings():
    local = torch.device("cpu")
    assert parse_device("auto", local) == local
    assert parse_device("cpu", local) == torch.device("cpu")
    with pytest.raises(PlacementError, match="device='tpu-ish:x' is not a device"):
        parse_device("tpu-ish:x", local)
    for spec in ("mps", "meta", "xpu:0"):  # real torch device types this trainer does not place roles on
        with pytest.raises(PlacementError, match=f"reward_model.device='{spec}': device type '.*' is not supported"):
            parse_device(spec, local, "reward_model.device")
    with pytest.raises(PlacementError, match="one CPU device"):
        parse_device("cpu:1", local)
    assert parse_device("cpu:0", local) == torch.device("cpu:0")
    if not torch.cuda.is_available():
        with pytest.raises(PlacementError, match="actor.device='cuda:0' asks for a CUDA GPU, but none is available"):
            parse_device("cuda:0", local, "actor.device")
    else:
        with pytest.raises(PlacementError, match="critic.device='cuda:99' asks for a GPU this machine does not have"):
            parse_device("cuda:99", local, "critic.device")


def test_default_plugin_builds_it(rlcore_pm):
    p = rlcore_pm.build("rlcore_placement_policy", request=PlacementRequest(rank_groups={"reward": [1]}),
                        dist=DistInfo(rank=1, world_size=2))
    assert p.ranks_for("reward") == [1] and p.holds("reward")
    with pytest.raises(PlacementError, match="world size is 2"):
        rlcore_pm.build("rlcore_placement_policy", request=PlacementRequest(rank_groups={"reward": [2]}),
                        dist=DistInfo(rank=0, world_size=2))


def test_one_process_holds_every_role_whatever_the_rank_groups():
    p = ColocatedPlacement(PlacementRequest(rank_groups={"reward": [1], "actor": [0, 2]}), DistInfo(world_size=1))
    assert not p.split
    assert all(p.holds(role) and p.ranks_for(role) == [0] for role in ("actor", "reward", "critic"))
    with pytest.raises(PlacementError, match="world size is 2"):  # with several processes they are checked
        ColocatedPlacement(PlacementRequest(rank_groups={"reward": [2]}), DistInfo(world_size=2))


def test_one_named_gpu_for_every_process_of_a_node_is_warned_about(monkeypatch, caplog):
    import logging

    from rlcore.distributed.placement import warn_shared_gpu

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with caplog.at_level(logging.WARNING):
        warn_shared_gpu(PlacementRequest(actor="cuda:0", reward="cuda:4"), DistInfo(world_size=8))
    assert "actor.device='cuda:0' puts the actor on the same GPU in each of the 8 processes" in caplog.text
    assert "reward_model.device='cuda:4'" in caplog.text and "placement.rank_groups.reward" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        warn_shared_gpu(PlacementRequest(reward="cuda:4", rank_groups={"reward": [7]}), DistInfo(world_size=8))
        warn_shared_gpu(PlacementRequest(actor="auto", reward="cuda"), DistInfo(world_size=8))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        warn_shared_gpu(PlacementRequest(actor="cuda:0"), DistInfo())
    assert caplog.text == ""
