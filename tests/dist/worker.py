"""Multi-case worker started by ``python -m torch.distributed.run`` from ``test_multiprocess.py``.

Every case builds the same tiny Qwen2 model, trains it for two optimizer steps on fixed data split
over the ranks, and generates greedily after each step; losses and tokens are compared with a
single-process reference computed here on the full batch. Rank 0 writes one JSON record per case to
``--out``; the pytest side asserts on the records.

Usage: ``worker.py --out FILE --cases a,b,c [--model-dir DIR]``; ``--cases die`` makes rank 1 fail.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as tdist

from rlcore.config.schema import FSDPConfig, RemeshingConfig
from rlcore.distributed import init as dinit
from rlcore.distributed.fsdp import apply_fsdp, build_mesh, enable_gradient_checkpointing, load_model_for_role
from rlcore.distributed.remesh import RemeshPolicy
from rlcore.distributed.reshard import FSDPReshardPolicy
from rlcore.protocols import DistInfo
from rlcore.rollout.base import SamplingParams
from rlcore.rollout.hf import HFGenerateBackend
from rlcore.rollout.tiny import tiny_causal_lm

BATCH, SEQ, LR, STEPS = 8, 12, 1e-2, 2
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, eos_token_ids=(), pad_token_id=0)


def fixed_data() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(1, 128, (BATCH, SEQ), generator=g)


def prompts_for(rank: int) -> list[list[int]]:
    """Two prompts of different lengths per rank (distinct over ranks)."""
    return [[1 + rank, 7, 9, 11 + rank], [3 + rank, 5, 2 + rank, 8, 13, 21]]


def mean_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def generate(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    batch = HFGenerateBackend(model).generate(prompts, GREEDY)
    return [r[m.bool()].tolist() for r, m in zip(batch.response_ids, batch.response_mask)]


def build_model(case: str = "") -> torch.nn.Module:
    """The tiny tied-embedding Qwen2; ``-v129`` cases use an odd vocabulary (embedding not split)."""
    return tiny_causal_lm("qwen2", vocab_size=129) if case.endswith("-v129") else tiny_causal_lm("qwen2")


def reference(world: int, case: str = "") -> dict:
    """Single-process run on the full batch: losses before each step and greedy tokens after it."""
    model = build_model(case)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ids, out = fixed_data(), {"loss": [], "tokens": []}
    for _ in range(STEPS):
        loss = mean_loss(model, ids)
        out["loss"].append(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            out["tokens"].append([generate(model, prompts_for(r)) for r in range(world)])
        model.train()
    with torch.no_grad():
        out["final_loss"] = float(mean_loss(model, ids))
    return out


def make_policy(case: str, dist: DistInfo):
    """``(policy, fsdp config, mesh or None)`` for a case name such as ``FULL_SHARD`` or ``remesh-t2-g1``."""
    if case.startswith("remesh"):
        t, g = (int(part[1:]) for part in case.split("-")[1:3])
        fsdp = FSDPConfig(param_dtype="fp32")
        remesh = RemeshingConfig(enabled=True, training_shard_size=t, generation_shard_size=g)
        return RemeshPolicy(fsdp, remesh, dist), fsdp, None
    strategy = case.split("-")[0]
    fsdp = FSDPConfig(sharding_strategy=strategy, param_dtype="bf16" if "bf16" in case else "fp32",
                      cpu_offload="offload" in case)
    mesh = build_mesh(strategy, dist, shard_size=2) if strategy == "HYBRID_SHARD" else None
    return FSDPReshardPolicy(fsdp, dist), fsdp, mesh


def run_case(case: str, dist: DistInfo, ref: dict) -> dict:
    policy, fsdp, mesh = make_policy(case, dist)
    model = build_model(case)
    model.train()
    if "ckpt" in case:
        enable_gradient_checkpointing(model)
    model = apply_fsdp(model, fsdp, dist, mesh=mesh) if mesh is not None else policy.prepare(model, "actor")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    per = BATCH // dist.world_size
    ids = fixed_data()[dist.rank * per:(dist.rank + 1) * per]
    losses, token_ok, stats = [], True, {}
    for step in range(STEPS):
        loss = mean_loss(model, ids)
        losses.append(dinit.all_reduce_mean({"loss": float(loss)})["loss"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad(), policy.generation(model) as gen:
            share = policy.generation_share(prompts_for(dist.rank), GREEDY)
            batch = share.own(HFGenerateBackend(gen).generate(share.prompts, share.params))
        model.train()
        got = [r[m.bool()].tolist() for r, m in zip(batch.response_ids, batch.response_mask)]
        token_ok &= got == ref["tokens"][step][dist.rank]
        stats = policy.stats()
    with torch.no_grad():
        final = dinit.all_reduce_mean({"loss": float(mean_loss(model, ids))})["loss"]
    oks = dinit.all_gather_object(token_ok)
    return {"loss": losses, "final_loss": final, "ref_loss": ref["loss"], "ref_final_loss": ref["final_loss"],
            "tokens_match": all(oks), "stats": sorted(stats)}


def check_sync_module_states(dist: DistInfo, model_dir: str) -> dict:
    """Weights after loading with sync_module_states true / false, and with per-rank random inits."""
    from transformers import AutoModelForCausalLM

    load = lambda: AutoModelForCausalLM.from_pretrained(model_dir)  # noqa: E731
    synced = load_model_for_role(load, FSDPConfig(sync_module_states=True), dist)
    each = load_model_for_role(load, FSDPConfig(sync_module_states=False), dist)
    random = load_model_for_role(lambda: tiny_causal_lm("qwen2", seed=100 + dist.rank),
                                 FSDPConfig(sync_module_states=True), dist)
    rank0 = tiny_causal_lm("qwen2", seed=100)

    def same(a, b) -> bool:
        sa, sb = a.state_dict(), b.state_dict()
        return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)

    def digest(m) -> float:
        return float(sum(t.double().sum() for t in m.state_dict().values()))

    return {"sync_vs_each": all(dinit.all_gather_object(same(synced, each))),
            "synced_digests": dinit.all_gather_object(digest(synced)),
            "random_broadcast": all(dinit.all_gather_object(same(random, rank0))),
            "tied": all(dinit.all_gather_object(synced.lm_head.weight is synced.model.embed_tokens.weight))}


def check_data_sharding(dist: DistInfo) -> dict:
    from rlcore.config.schema import DataConfig
    from rlcore.data.loader import PromptLoader

    rows = [{"prompt": f"row {i}", "input_ids": [i + 1]} for i in range(32)]
    loader = PromptLoader(rows, DataConfig(shuffle=True), 4, 0, dist)
    mine = [r["prompt"] for _ in range(2) for r in loader.next_batch()]
    return {"rows": dinit.all_gather_object(mine)}


def check_gradient_accumulation(dist: DistInfo) -> dict:
    """One optimizer step of ``ppo_update`` with 1 and with 4 micro-batches: the gradient reductions
    (reduce-scatters, counted by the profiler) and the resulting weights."""
    from torch.profiler import ProfilerActivity, profile

    from rlcore.config.schema import PPOConfig
    from rlcore.trainer.experience import Experience
    from rlcore.trainer.update import ppo_update

    g = torch.Generator().manual_seed(100 + dist.rank)  # each rank its own samples
    ids = torch.randint(3, 100, (BATCH, SEQ), generator=g)
    resp = 4
    exp = Experience(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(BATCH, resp),
                     old_logprobs=None, scores=torch.zeros(BATCH),
                     advantages=torch.randn(BATCH, resp, generator=g))
    out, deltas = {}, {}
    for accum in (1, 4):
        torch.manual_seed(0)
        model = apply_fsdp(build_model(), FSDPConfig(param_dtype="fp32"), dist)
        before = [p.full_tensor().detach().clone() for p in model.parameters()]
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        ppo = PPOConfig(mini_batch_size=BATCH, ppo_epochs=1, trim_padding=False)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            ppo_update(exp, actor=model, actor_opt=opt, actor_sched=sched, actor_grad_clip=0.0, ppo=ppo,
                       grad_accum=accum, temperature=1.0, kl_loss_coef=0.0, generator=torch.Generator().manual_seed(0))
        names = [e.name for e in prof.events()]
        out[f"reduce_scatters_{accum}"] = sum("reduce_scatter" in n for n in names)
        deltas[accum] = torch.cat([(p.full_tensor().detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    out["update_norm"] = float(deltas[1].norm())
    out["update_diff"] = float((deltas[4] - deltas[1]).norm() / deltas[1].norm())  # relative
    return out


def check_critic_fsdp(dist: DistInfo) -> dict:
    """The critic is sharded with its own settings, not the actor's the policy was built with."""
    from rlcore.trainer.models import ValueModel

    actor_fsdp, critic_fsdp = FSDPConfig(param_dtype="fp32"), FSDPConfig(param_dtype="bf16")
    policy = FSDPReshardPolicy(actor_fsdp, dist)
    dtypes = {}
    for role, fsdp in (("actor", actor_fsdp), ("critic", critic_fsdp)):
        model = ValueModel.from_causal_lm(build_model()) if role == "critic" else build_model()
        model = policy.prepare(model, role, fsdp=fsdp)
        seen = []
        layer = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))
        layer.register_forward_hook(lambda m, a, o: seen.append(str((o[0] if isinstance(o, tuple) else o).dtype)))
        ids = torch.randint(3, 100, (2, SEQ))
        with torch.no_grad():
            if role == "critic":
                model(ids, torch.ones_like(ids), torch.arange(SEQ).expand(2, SEQ))
            else:
                model(ids)
        dtypes[role] = seen[0]
    return dtypes


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--model-dir", default="")
    args = parser.parse_args()
    dist = dinit.init_distributed("cpu")
    cases = args.cases.split(",")
    if cases == ["die"]:
        if dist.rank == 1:
            raise RuntimeError("injected failure on rank 1")
        tdist.all_reduce(torch.ones(1))  # rank 0 waits here until the launcher stops it
        return 0
    refs = {"": reference(dist.world_size)}
    records = {}
    for case in cases:
        if case == "sync":
            records[case] = check_sync_module_states(dist, args.model_dir)
        elif case == "data":
            records[case] = check_data_sharding(dist)
        elif case == "grad-accum":
            records[case] = check_gradient_accumulation(dist)
        elif case == "critic-fsdp":
            records[case] = check_critic_fsdp(dist)
        else:
            variant = "-v129" if case.endswith("-v129") else ""
            if variant not in refs:
                refs[variant] = reference(dist.world_size, variant)
            records[case] = run_case(case, dist, refs[variant])
        if dist.is_main:
            print(f"case {case}: {json.dumps(records[case])}", flush=True)
    if dist.is_main:
        with open(args.out, "w") as f:
            json.dump({"world_size": dist.world_size, "cases": records}, f)
    dinit.barrier()
    dinit.destroy()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
