"""Worker for ``test_reward_placement.py``, started by torchrun: the reward role on rank 0 only.

``--case scores``: both ranks score their own samples through the trainer's reward path with
``placement.rank_groups.reward=[0]`` and a tiny Hugging Face reward model; rank 0 then scores every
rank's samples with a colocated backend of its own. Rank 0 writes ``result.json`` to ``--out``: the
routed and the colocated scores, and how many times each rank loaded the reward model.

``--case raise``: a custom reward function that raises on one of rank 1's samples (scored on rank 0);
each rank writes the message it got to ``error<rank>.txt`` in ``--out`` and exits with it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rlcore.config.loader import load_config
from rlcore.distributed import init as dinit
from rlcore.errors import RewardError
from rlcore.plugin_manager import build_plugin_manager
from rlcore.protocols import RewardInput
from rlcore.rewards.reward_model import RewardModel
from rlcore.trainer.components import build_placement, build_reward, obj

RAISING_FN = '''
def compute_score(response, **kwargs):
    if "boom" in response:
        raise ValueError("reward blew up on purpose")
    return float(len(response))
'''


def count_loads() -> list:
    """Record every reward-model load in this process."""
    loads, original = [], RewardModel.load.__func__

    def load(cls, *args, **kwargs):
        loads.append(1)
        return original(cls, *args, **kwargs)

    RewardModel.load = classmethod(load)
    return loads


def batch_for(rank: int, step: int, tok) -> RewardInput:
    prompts = [f"a b {'c ' * rank}", f"d e{' f' * step}", "g"]
    responses = ["h i", "j" + " k" * (rank + 1), "boom" if rank == 1 and step < 0 else "l m n"]
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return RewardInput(prompts=prompts, responses=responses, prompt_ids=[ids(p) for p in prompts],
                       response_ids=[ids(r) for r in responses], extras={})


def reward_for(overrides: list[str], dist, tok):
    cfg = load_config(overrides=["placement.rank_groups.reward=[0]", *overrides])
    pm = build_plugin_manager([])
    placement = build_placement(pm, dist, obj(cfg.actor), obj(cfg.critic), obj(cfg.reward_model),
                                obj(cfg.placement))
    return cfg, build_reward(cfg, pm, placement, tok, dist)


def case_scores(args, dist, tok) -> None:
    loads = count_loads()
    rm = [f"reward_model.path={args.rm}", "reward_model.enable=true", "reward_model.dtype=fp32",
          "reward_model.device=cpu", "reward_model.micro_batch_size=2"]
    cfg, reward = reward_for(rm, dist, tok)
    batches = [batch_for(dist.rank, step, tok) for step in range(2)]
    routed = [reward.score(b).scores.tolist() for b in batches]
    load_counts = dinit.all_gather_object(len(loads))
    every_batch = dinit.all_gather_object(batches)
    every_routed = dinit.all_gather_object(routed)
    if dist.is_main:
        from rlcore.distributed.placement import ColocatedPlacement
        from rlcore.protocols import DistInfo, PlacementRequest
        from rlcore.rewards.backend import build_reward_backend

        local = build_reward_backend(obj(cfg.reward_model), obj(cfg.custom_reward_function), obj(cfg.reward),
                                     ColocatedPlacement(PlacementRequest(reward="cpu"), DistInfo()), tok, {})
        colocated = [[local.score(b).scores.tolist() for b in mine] for mine in every_batch]
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"routed": every_routed, "colocated": colocated, "loads": load_counts,
                       "backend_on": dinit.all_gather_object(reward.backend is not None)}, f)
    else:
        dinit.all_gather_object(reward.backend is not None)


def case_raise(args, dist, tok) -> None:
    path = os.path.join(args.out, "raising_reward.py")
    if dist.is_main:
        with open(path, "w") as f:
            f.write(RAISING_FN)
    dinit.barrier()
    _, reward = reward_for([f"custom_reward_function.path={path}"], dist, tok)
    try:
        reward.score(batch_for(dist.rank, -1, tok))
    except RewardError as e:
        with open(os.path.join(args.out, f"error{dist.rank}.txt"), "w") as f:
            f.write(str(e))
        raise


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rm", required=True)
    parser.add_argument("--case", choices=["scores", "raise"], required=True)
    args = parser.parse_args()
    dist = dinit.init_distributed("cpu")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.rm)
    {"scores": case_scores, "raise": case_raise}[args.case](args, dist, tok)
    dinit.barrier()
    dinit.destroy()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
