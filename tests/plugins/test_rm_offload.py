"""The ``rm-offload`` plugin: placement decisions, start-up validation, equal scores in every placement."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from rlcore.config.schema import RewardConfig, RewardFunctionConfig, RewardModelConfig
from rlcore.distributed.placement import ColocatedPlacement
from rlcore.errors import PlacementError
from rlcore.plugins import rm_offload
from rlcore.plugins.rm_offload import SwappedScorer, plan_placement
from rlcore.protocols import DistInfo, PlacementRequest, RewardInput
from rlcore.rewards.backend import build_reward_backend
from rlcore.rewards.reward_model import ResidentScorer, RewardModel
from rlcore.rewards.rules import BUILTIN_REWARDS
from rlcore.rewards.tiny import build_tiny_reward_model

CPU, GPU0, GPU1, GPU3 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 3)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return build_tiny_reward_model(str(tmp_path_factory.mktemp("rm") / "rm"), layers=3)


@pytest.fixture(scope="module")
def tok(rm_dir):
    return AutoTokenizer.from_pretrained(rm_dir)


@pytest.fixture(scope="module")
def batch(tok):
    prompts, responses = ["a b c", "d e f g", "h", "i j"], ["k l", "a", "b c d e f", "g"]
    ids = lambda t: tok.convert_tokens_to_ids(t.split())  # noqa: E731
    return RewardInput(prompts=prompts, responses=responses, prompt_ids=[ids(p) for p in prompts],
                       response_ids=[ids(r) for r in responses], extras={"ground_truth": ["k l", "b", "x", "g"]})


def rm_cfg(path, **kw):
    return RewardModelConfig(enable=True, path=path, **{"dtype": "fp32", "micro_batch_size": 3, **kw})


def cpu_placement(offload=False):
    return ColocatedPlacement(PlacementRequest(reward="cpu", reward_offload=offload), DistInfo())


# -- decisions ----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, offload, reward, actor, gpus, local, mode, device", [
    ("cpu", False, CPU, GPU0, 1, 1, "cpu", CPU),
    ("cpu", True, CPU, GPU0, 1, 1, "cpu", CPU),            # nothing to swap: it already rests on the CPU
    ("auto", False, CPU, CPU, 0, 1, "cpu", CPU),           # a machine without GPU
    ("cuda:1", False, GPU1, GPU0, 2, 1, "gpu", GPU1),      # its own GPU
    ("cuda:0", False, GPU0, GPU0, 1, 1, "gpu", GPU0),      # asked to share the actor's GPU
    ("cuda:0", True, GPU0, GPU0, 1, 1, "swap", GPU0),
    ("auto", True, GPU0, GPU0, 4, 1, "swap", GPU0),
    ("auto", False, GPU0, GPU0, 4, 1, "gpu", GPU1),        # a GPU nobody uses
    ("auto", False, GPU0, GPU0, 4, 3, "gpu", GPU3),        # ranks use cuda:0..2
    ("auto", False, GPU0, GPU0, 1, 1, "swap", GPU0),       # no free GPU: swap onto the actor's
    ("auto", False, GPU1, GPU1, 2, 2, "swap", GPU1),       # every GPU holds a rank
])
def test_placement_decisions(spec, offload, reward, actor, gpus, local, mode, device):
    plan = plan_placement(spec, offload, reward, actor, gpus, local)
    assert (plan.mode, plan.device) == (mode, device) and plan.reason


def test_cuda_n_beyond_the_machine_fails_at_start_up(monkeypatch, rm_dir, tok):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(PlacementError, match=r"'cuda:4'.*1 GPU\(s\)"):  # from the placement policy
        ColocatedPlacement(PlacementRequest(reward="cuda:4"), DistInfo())
    # a placement policy that did not check: the plugin checks before loading anything
    with pytest.raises(PlacementError, match=r"'cuda:4'.*1 GPU\(s\)"):
        rm_offload.rlcore_reward_backend(reward_model=rm_cfg("/nonexistent", device="cuda:4"),
                                         reward_function=RewardFunctionConfig(), reward=RewardConfig(),
                                         placement=cpu_placement(), tokenizer=tok, rewards={})


def test_plugin_passes_when_no_reward_model(tok):
    assert rm_offload.rlcore_reward_backend(reward_model=RewardModelConfig(), reward_function=RewardFunctionConfig(),
                                            reward=RewardConfig(), placement=cpu_placement(), tokenizer=tok,
                                            rewards={}) is None


# -- equal scores in every placement ------------------------------------------------------------


def test_scores_equal_in_every_placement(rm_dir, tok, batch):
    ref = build_reward_backend(rm_cfg(rm_dir), RewardFunctionConfig(), RewardConfig(), cpu_placement(), tok,
                               dict(BUILTIN_REWARDS)).score(batch).scores
    plugin = rm_offload.rlcore_reward_backend(reward_model=rm_cfg(rm_dir, device="cpu", offload=True),
                                              reward_function=RewardFunctionConfig(), reward=RewardConfig(),
                                              placement=cpu_placement(offload=True), tokenizer=tok, rewards={})
    assert plugin.rm_placement.mode == "cpu"
    torch.testing.assert_close(plugin.score(batch).scores, ref, rtol=1e-5, atol=1e-5)
    swapped = SwappedScorer(RewardModel.load(rm_cfg(rm_dir), tok), CPU)  # "GPU" = the CPU: the swap path runs
    torch.testing.assert_close(torch.tensor(swapped(batch).scores), ref, rtol=1e-5, atol=1e-5)
    bf16 = SwappedScorer(RewardModel.load(rm_cfg(rm_dir, dtype="bf16"), tok), CPU)
    torch.testing.assert_close(torch.tensor(bf16(batch).scores), ref, rtol=0.05, atol=0.1)


def test_swap_moves_weights_only_while_scoring(rm_dir, tok, batch):
    rm = RewardModel.load(rm_cfg(rm_dir), tok)
    scorer = SwappedScorer(rm, CPU)
    params = dict(rm.module.named_parameters())
    home = {n: p.data_ptr() for n, p in params.items()}
    seen = {}

    def spy(module, args):
        seen.update({n: p.data_ptr() for n, p in params.items()})

    handle = rm.module.model.register_forward_pre_hook(spy)  # the backbone runs first
    try:
        scorer(batch)
    finally:
        handle.remove()
    assert seen and all(seen[n] != home[n] for n in params)  # scored with copies on the compute device
    assert {n: p.data_ptr() for n, p in params.items()} == home and not scorer.on_gpu  # released afterwards
    # every parameter and buffer is in exactly one copy group: the shared parts, then one group per layer
    groups = rm_offload._tensor_groups(rm.module)
    assert len(groups) == 1 + rm.module.config.num_hidden_layers
    slots = [id(s.param) if s.param is not None else (id(s.module), s.name) for g in groups for s in g]
    assert len(slots) == len(set(slots)) == len(params) + len(list(rm.module.buffers()))


def test_swap_is_undone_when_scoring_fails(rm_dir, tok):
    rm = RewardModel.load(rm_cfg(rm_dir), tok)
    scorer = SwappedScorer(rm, CPU)
    home = [p.data_ptr() for p in rm.module.parameters()]
    bad = RewardInput(prompts=[""], responses=[""], prompt_ids=[[]], response_ids=[[]])
    with pytest.raises(Exception, match="empty"):
        scorer(bad)
    assert [p.data_ptr() for p in rm.module.parameters()] == home


def test_plugin_selected_by_name_answers_the_factory_hook(monkeypatch, rm_dir, tok, batch):
    from rlcore.plugin_manager import build_plugin_manager

    # force the swap mode on a CPU-only machine to run the whole plugin path
    monkeypatch.setattr(rm_offload, "plan_placement",
                        lambda *a, **k: rm_offload.RMPlacement("swap", CPU, "test: swap onto the CPU"))
    pm = build_plugin_manager(["rm-offload"])
    rewards = {}
    pm.hook.rlcore_register_rewards(register=lambda n, f: rewards.__setitem__(n, f))
    be = pm.build("rlcore_reward_backend", reward_model=rm_cfg(rm_dir, offload=True),
                  reward_function=RewardFunctionConfig(), reward=RewardConfig(weights={"exact_match": 1.0}),
                  placement=cpu_placement(offload=True), tokenizer=tok, rewards=rewards, run_dir="")
    assert isinstance(be.rm, SwappedScorer)
    resident = ResidentScorer(RewardModel.load(rm_cfg(rm_dir), tok), CPU)(batch).scores
    out = be.score(batch)
    torch.testing.assert_close(out.scores, torch.tensor(resident) + torch.tensor([1.0, 0.0, 0.0, 1.0]))
    assert set(out.metrics) >= {"reward/rm", "reward/exact_match", "time/reward_model_s"}
