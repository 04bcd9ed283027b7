"""``placement.rank_groups``: config keys, early errors, the request the trainer builds, and its checks."""

from __future__ import annotations

import pytest

from rlcore.config.loader import load_config
from rlcore.errors import ConfigError, PlacementError
from rlcore.protocols import DistInfo
from rlcore.trainer.components import build_components, build_placement, obj


def placement_for(overrides, rank=0, world=2, pm=None):
    from rlcore.plugin_manager import build_plugin_manager

    cfg = load_config(overrides=overrides)
    return build_placement(pm or build_plugin_manager([]), DistInfo(rank=rank, world_size=world), obj(cfg.actor),
                           obj(cfg.critic), obj(cfg.reward_model), obj(cfg.placement))


def test_default_is_colocated():
    assert obj(load_config().placement).rank_groups == {}
    p = placement_for([], world=4)
    assert not p.split and p.ranks_for("reward") == [0, 1, 2, 3]


def test_config_reaches_the_placement_request():
    seen = {}

    class Spy:
        @staticmethod
        def rlcore_placement_policy(request, dist):
            from rlcore.distributed.placement import ColocatedPlacement

            seen["groups"] = dict(request.rank_groups)
            return ColocatedPlacement(request, dist)

    from rlcore.hookspecs import hookimpl
    from rlcore.plugin_manager import build_plugin_manager

    Spy.rlcore_placement_policy = hookimpl(Spy.rlcore_placement_policy)
    pm = build_plugin_manager([])
    pm.register_plugin(Spy, "spy")
    p = placement_for(["placement.rank_groups.reward=[3]"], rank=1, world=4, pm=pm)
    assert seen["groups"] == {"reward": [3]}
    assert p.ranks_for("reward") == [3] and not p.holds("reward") and p.ranks_for("actor") == [0, 1, 2, 3]


def test_yaml_file_and_every_rank_listed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("placement:\n  rank_groups:\n    reward: [1, 0]\n    actor: [0, 1]\n")
    cfg = load_config([str(path)])
    assert obj(cfg.placement).rank_groups == {"reward": [1, 0], "actor": [0, 1]}
    p = placement_for(["placement.rank_groups={reward: [1, 0], actor: [0, 1]}"])
    assert p.ranks_for("reward") == [0, 1] and not p.split  # actor on all ranks of 2 is no split


@pytest.mark.parametrize("override, message", [
    ("placement.rank_groups.rewards=[0]", r"'placement.rank_groups.rewards': unknown role 'rewards'.*'reward'"),
    ("placement.rank_groups.policy=[0]", r"'placement.rank_groups.policy': unknown role 'policy'"),
    ("placement.rank_groups.reward=[a]", r"'placement.rank_groups.reward': ranks must be integers >= 0"),
    ("placement.rank_groups.reward=[0.5]", r"'placement.rank_groups.reward': ranks must be integers"),
    ("placement.rank_groups.reward=[-1]", r"'placement.rank_groups.reward': ranks must be integers >= 0"),
    ("placement.rank_groups.reward=[true]", r"'placement.rank_groups.reward': ranks must be integers"),
    ("placement.rank_groups.reward=0", r"'placement.rank_groups.reward' must be a list of global ranks"),
    ("placement.rank_groups.reward=[]", r"'placement.rank_groups.reward' is empty"),
    ("placement.rank_groups.reward=[1,1]", r"'placement.rank_groups.reward': \[1, 1\] repeats a rank"),
])
def test_loader_rejects_bad_values_early(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


@pytest.mark.parametrize("role", ["actor", "critic", "ref"])
def test_training_roles_on_a_subset_are_refused(role):
    with pytest.raises(PlacementError) as info:
        placement_for([f"placement.rank_groups.{role}=[0]"], world=2)
    text = str(info.value)
    assert f"placement.rank_groups.{role} = [0]" in text and "1 of the 2 ranks" in text
    assert "Only the 'reward' role can be split" in text and "FSDP over every rank" in text


def test_rank_outside_the_world_is_refused_when_built():
    load_config(overrides=["placement.rank_groups.reward=[2]"])  # the world size is not known yet
    with pytest.raises(PlacementError, match=r"role 'reward' placed on ranks \[2\], but the world size is 2"):
        placement_for(["placement.rank_groups.reward=[2]"], world=2)


def test_bad_placement_fails_before_any_model_loads(monkeypatch):
    from rlcore.trainer import models
    from rlcore.plugin_manager import build_plugin_manager

    def forbidden(*a, **k):
        raise AssertionError("a model or tokenizer was loaded before the placement was checked")

    monkeypatch.setattr(models, "load_tokenizer", forbidden)
    monkeypatch.setattr(models, "load_causal_lm", forbidden)
    cfg = load_config(overrides=["placement.rank_groups.actor=[1]", "placement.rank_groups.reward=[0]",
                                 "actor.model_path=never-loaded"])
    with pytest.raises(PlacementError, match="Only the 'reward' role"):
        build_components(cfg, build_plugin_manager([]), DistInfo(rank=0, world_size=2))


@pytest.mark.parametrize("launch", ["nproc", "torchrun"])
def test_validate_checks_rank_groups_against_the_launch_size(monkeypatch, capsys, tmp_path, launch):
    from rlcore.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    size = ["trainer.nproc_per_node=2"] if launch == "nproc" else []
    if launch == "torchrun":
        monkeypatch.setenv("WORLD_SIZE", "2")
    common = [f"trainer.output_dir={tmp_path}", *size]
    assert main(["validate", *common, "placement.rank_groups.reward=[2]"]) == 2
    assert "world size is 2" in capsys.readouterr().err
    assert main(["validate", *common, "placement.rank_groups.critic=[1]"]) == 2
    assert "Only the 'reward' role can be split" in capsys.readouterr().err
    assert main(["validate", *common, "placement.rank_groups.reward=[1]"]) == 0


def test_devices_of_roles_the_run_lacks_are_not_checked():
    import torch

    if torch.cuda.device_count() > 7:
        pytest.skip("needs a machine without a cuda:7")
    from rlcore.plugin_manager import build_plugin_manager

    placement_for(["reward_model.device=cuda:7"], world=1)  # no reward model: inert, as the warning says
    with pytest.raises(PlacementError, match="reward_model.device='cuda:7'"):
        placement_for(["reward_model.device=cuda:7", "reward_model.enable=true"], world=1)
    cfg = load_config(overrides=["critic.device=cuda:7"])
    args = (build_plugin_manager([]), DistInfo(), obj(cfg.actor), obj(cfg.critic), obj(cfg.reward_model),
            obj(cfg.placement))
    build_placement(*args, uses_critic=False)  # GRPO/RLOO train no critic
    with pytest.raises(PlacementError, match="critic.device='cuda:7'"):
        build_placement(*args)
