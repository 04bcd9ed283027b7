"""The ``remesh`` reshard policy: one shard layout for training, another for generation.

With ``W`` ranks, ``t = actor.remeshing.training_shard_size`` and ``g = generation_shard_size``:

* **training** — HSDP: ``fully_shard`` over a ``(W/t, t)`` mesh. Each group of ``t`` consecutive
  ranks shards one copy of the model; the ``W/t`` groups replicate it (gradients are averaged
  across groups). ``t == W`` is plain FSDP over a 1-D mesh.
* **generation** — ``W/g`` replicas of ``g`` consecutive ranks each; inside a replica the decoder
  is tensor parallel (DTensor ``parallelize_module``: q/k/v, gate/up column-wise, o/down row-wise,
  embedding and head split over the vocabulary). Each replica generates the prompts of its ``g``
  ranks and every rank gets back the results of its own prompts.

Switching to generation fills the tensor-parallel weights from the training shards, one
parameter at a time: when ``g == t`` the two layouts live on the same mesh and each weight is a
single DTensor ``redistribute`` (``Shard(0)`` -> ``Shard(k)``: an all-to-all, no rank ever holds a
full weight); otherwise each weight is gathered inside its training group, the rank keeps its
tensor-parallel slice, and the full weight is dropped before the next one. The full model is
never held by a rank. Switching back frees the generation weights (the training shards were
never touched). With ``g == 1`` every rank is a replica and generates on its training group's
gathered weights, as the default policy does.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from rlcore.config.schema import FSDPConfig, RemeshingConfig, torch_dtype
from rlcore.distributed.fsdp import RESHARD_AFTER_FORWARD, apply_fsdp, check_fsdp_config
from rlcore.distributed.reshard import SwitchTimer, gathered
from rlcore.errors import ConfigError
from rlcore.protocols import DistInfo, GenerationShare
from rlcore.rollout.base import SamplingParams

log = logging.getLogger(__name__)

KEY = "actor.remeshing"
COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def check_sizes(remeshing: RemeshingConfig, world_size: int) -> None:
    """Raise :class:`ConfigError` listing every size that does not fit ``world_size`` ranks."""
    problems = []
    for name in ("training_shard_size", "generation_shard_size"):
        size = getattr(remeshing, name)
        if not isinstance(size, int) or size < 1:
            problems.append(f"'{KEY}.{name}' = {size!r}: must be an integer >= 1")
        elif world_size % size:
            problems.append(f"'{KEY}.{name}' = {size} does not divide the world size {world_size} "
                            f"(divisors: {', '.join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)})")
    if problems:
        raise ConfigError(problems)


def check_model(model: nn.Module, g: int) -> None:
    """Raise :class:`ConfigError` when ``model`` cannot be split into ``g`` tensor-parallel parts."""
    if g == 1:
        return
    cfg = getattr(model, "config", None)
    problems = []
    for attr in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(cfg, attr, None)
        if value is None:
            problems.append(f"'{KEY}.generation_shard_size' = {g}: the model config has no '{attr}' "
                            "(tensor-parallel generation supports Llama/Mistral/Qwen2-style decoders)")
        elif value % g:
            problems.append(f"'{KEY}.generation_shard_size' = {g} does not divide the model's {attr} = {value}")
    if not problems and not tp_plan(model):
        problems.append(f"'{KEY}.generation_shard_size' = {g}: {type(model).__name__} has no "
                        "q/k/v/o and gate/up/down projections to split")
    if problems:
        raise ConfigError(problems)


def tp_plan(model: nn.Module) -> dict[str, str]:
    """``module name -> "colwise" | "rowwise" | "embedding" | "head"`` for the tensor-parallel layout."""
    from rlcore.distributed.fsdp import decoder_layers

    names = {id(m): n for n, m in model.named_modules()}
    plan: dict[str, str] = {}
    for layer in decoder_layers(model):
        prefix = names[id(layer)]
        for suffix, style in [(s, "colwise") for s in COLWISE] + [(s, "rowwise") for s in ROWWISE]:
            sub = layer.get_submodule(suffix) if _has(layer, suffix) else None
            if isinstance(sub, nn.Linear):
                plan[f"{prefix}.{suffix}"] = style
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if plan and vocab and isinstance(emb, nn.Embedding) and isinstance(head, nn.Linear):
        plan[names[id(emb)]] = "embedding"
        plan[names[id(head)]] = "head"
    return plan


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def meta_skeleton(model: nn.Module, dtype: Optional[torch.dtype]) -> nn.Module:
    """A copy of ``model`` whose parameters (cast to ``dtype``) and buffers live on the meta device.

    Tied parameters stay tied; no weight memory is used.
    """
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        if id(p) not in memo:
            memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta", dtype=dtype or p.dtype),
                                       requires_grad=False)
    for b in model.buffers():
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    return copy.deepcopy(model, memo)


def local_chunk(full: torch.Tensor, placement, coordinate: int, parts: int) -> torch.Tensor:
    """This rank's piece of ``full`` under a DTensor ``placement`` (``Shard(k)`` follows ``torch.chunk``)."""
    dim = getattr(placement, "dim", None)
    if dim is None:
        return full
    chunks = torch.chunk(full, parts, dim=dim)
    return chunks[coordinate] if coordinate < len(chunks) else full.narrow(dim, 0, 0)


class TensorParallelReplica:
    """The generation copy of the actor: a tensor-parallel module over a ``g``-rank mesh, whose
    weights are allocated only between :meth:`load` and :meth:`release`."""

    def __init__(self, model: nn.Module, tp_mesh, dtype: Optional[torch.dtype], device: torch.device):
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        styles = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
                  "embedding": RowwiseParallel(input_layouts=Replicate()),
                  "head": ColwiseParallel(output_layouts=Replicate())}
        plan = tp_plan(model)
        if model.config.vocab_size % tp_mesh.size():
            plan = {k: v for k, v in plan.items() if v not in ("embedding", "head")}
        self.mesh = tp_mesh
        self.dtype = dtype
        self.device = device
        self.module = meta_skeleton(model, dtype)
        tied = self._tied_head(self.module)
        parallelize_module(self.module, tp_mesh, {name: styles[kind] for name, kind in plan.items()})
        self._retie(tied)
        self.module.to_empty(device=device)
        self._retie(tied)  # materialising plain (not DTensor) parameters may create new objects
        with torch.no_grad():
            own = dict(model.named_buffers())
            for name, buf in self.module.named_buffers():
                buf.copy_(own[name])
        self.params = [(n, p) for n, p in self.module.named_parameters()]
        self.locals = [p.to_local() if hasattr(p, "to_local") else p.data for _, p in self.params]
        self.nbytes = [t.untyped_storage().nbytes() for t in self.locals]
        self.loaded = True
        self.release()
        self.module.eval()

    def _retie(self, tied: bool) -> None:
        if tied:
            self.module.get_output_embeddings().weight = self.module.get_input_embeddings().weight

    @staticmethod
    def _tied_head(module: nn.Module) -> bool:
        emb = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
        head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
        return emb is not None and head is not None and head.weight is emb.weight

    @property
    def weight_bytes(self) -> int:
        return sum(self.nbytes)

    @torch.no_grad()
    def load(self, trained: nn.Module, aligned: bool) -> None:
        """Fill the tensor-parallel weights from ``trained``'s FSDP shards, one parameter at a time.

        :param aligned: the training mesh's shard dimension is this replica's mesh, so each weight
            is one ``redistribute`` on that mesh; else each weight is gathered and sliced.
        """
        source = dict(trained.named_parameters(remove_duplicate=False))
        coordinate = self.mesh.get_local_rank()
        for (name, param), local, nbytes in zip(self.params, self.locals, self.nbytes):
            local.untyped_storage().resize_(nbytes)
            src = source[name]
            if self.dtype is not None and src.dtype != self.dtype:
                src = src.to(self.dtype)
            if src.device != self.device:  # CPU-offloaded training shards
                src = src.to(self.device, non_blocking=True)
            target = param.placements[0] if hasattr(param, "placements") else None
            if aligned and hasattr(src, "redistribute"):
                from torch.distributed.tensor import Replicate

                lead = tuple(Replicate() for _ in range(src.device_mesh.ndim - 1))
                piece = src.redistribute(src.device_mesh, lead + (target or Replicate(),)).to_local()
            else:
                full = src.full_tensor() if hasattr(src, "full_tensor") else src
                piece = local_chunk(full, target, coordinate, self.mesh.size())
            if piece.shape != local.shape:
                raise RuntimeError(f"remesh: {name}: slice {tuple(piece.shape)} does not match the "
                                   f"generation shard {tuple(local.shape)}")
            local.copy_(piece)
            del piece
        self.loaded = True

    def release(self) -> None:
        """Free the generation weights (the module keeps its structure)."""
        if not self.loaded:
            return
        for t in self.locals:
            t.untyped_storage().resize_(0)
        self.loaded = False


class RemeshPolicy:
    """Training: HSDP groups of ``training_shard_size`` ranks. Generation: tensor-parallel
    replicas of ``generation_shard_size`` ranks. See the module docstring."""

    def __init__(self, fsdp: FSDPConfig, remeshing: RemeshingConfig, dist: DistInfo):
        check_fsdp_config(fsdp)
        check_sizes(remeshing, dist.world_size)
        self.fsdp, self.remeshing, self.dist = fsdp, remeshing, dist
        self.t, self.g = remeshing.training_shard_size, remeshing.generation_shard_size
        self.reshard_after_forward = RESHARD_AFTER_FORWARD[fsdp.sharding_strategy]
        self._timer = SwitchTimer(dist.device)
        self._train_mesh = None
        self._gen_mesh = None
        self.replica: Optional[TensorParallelReplica] = None
        self._actor: Optional[nn.Module] = None

    # -- meshes -------------------------------------------------------------------------------
    @property
    def aligned(self) -> bool:
        """Generation groups are the training shard groups (same mesh)."""
        return self.g == self.t

    def train_mesh(self):
        if self._train_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            from rlcore.distributed.fsdp import device_type

            w = self.dist.world_size
            # One group sharding everything is plain FSDP: a 1-D mesh, so FSDP2 runs no all-reduce
            # over a size-1 replicate dimension (nor keeps its gradient-sized buffers).
            shape, names = ((w,), ("shard",)) if self.t == w else ((w // self.t, self.t), ("replicate", "shard"))
            self._train_mesh = init_device_mesh(device_type(self.dist), shape, mesh_dim_names=names)
        return self._train_mesh

    def tp_mesh(self):
        """The 1-D mesh of this rank's generation replica."""
        if self.aligned:
            mesh = self.train_mesh()
            return mesh if mesh.ndim == 1 else mesh["shard"]
        if self._gen_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            from rlcore.distributed.fsdp import device_type

            w = self.dist.world_size
            self._gen_mesh = init_device_mesh(device_type(self.dist), (w // self.g, self.g),
                                              mesh_dim_names=("dp", "tp"))
        return self._gen_mesh["tp"]

    # -- ReshardPolicy --------------------------------------------------------------------------
    def prepare(self, model: nn.Module, role: str, fsdp: Optional[FSDPConfig] = None) -> nn.Module:
        """Shard ``model`` in HSDP groups (with ``fsdp``, default the policy's settings); for the actor
        also build its (empty) generation replica."""
        if not self.dist.distributed:
            return model
        with self._timer.measure(f"prepare_{role}"):
            if role == "actor" and self.g > 1:
                check_model(model, self.g)
                dtype = None if self.fsdp.param_dtype == "fp32" else torch_dtype(self.fsdp.param_dtype)
                self.replica = TensorParallelReplica(model, self.tp_mesh(), dtype, self.dist.device)
            model = apply_fsdp(model, fsdp or self.fsdp, self.dist, mesh=self.train_mesh())
        if role == "actor":
            self._actor = model
        return model

    @contextlib.contextmanager
    def generation(self, model: nn.Module) -> Iterator[nn.Module]:
        """Yield the module to generate with: the tensor-parallel replica (``g > 1``) or ``model``
        with its training group's weights gathered (``g == 1``)."""
        if not self.dist.distributed:
            yield model
            return
        if self.replica is None:
            with gathered(model, self._timer, self.reshard_after_forward) as full:
                yield full
            return
        if model is not self._actor:
            raise RuntimeError("remesh: generation() was given a model that prepare(model, 'actor') did not return")
        with self._timer.measure("to_gen"):
            self.replica.load(model, self.aligned)
        try:
            yield self.replica.module
        finally:
            with self._timer.measure("to_train"):
                self.replica.release()

    def generation_share(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationShare:
        """Pool the prompts of this rank's replica: every rank of the replica generates them together
        (same sampling seed: the replica's first rank's) and keeps its own rows."""
        if self.replica is None or self.g == 1:
            return GenerationShare(prompts, params)
        import torch.distributed as tdist

        mesh = self.tp_mesh()
        mine = [list(map(int, p)) for p in prompts]
        pooled: list = [None] * self.g
        tdist.all_gather_object(pooled, (mine, params.seed), group=mesh.get_group())
        everything = [p for part, _ in pooled for p in part]
        index = mesh.get_local_rank()
        start = sum(len(part) for part, _ in pooled[:index])
        if not everything:
            return GenerationShare(prompts, params)
        return GenerationShare(everything, dataclasses.replace(params, seed=pooled[0][1]), (start, start + len(mine)))

    def stats(self) -> dict[str, float]:
        """``reshard/to_gen_s``, ``reshard/to_train_s`` (plus ``*_peak_gb`` on CUDA) and the
        generation weights held per rank, ``reshard/gen_weights_gb``."""
        out = {k: v for k, v in self._timer.values.items() if not k.startswith("reshard/prepare_")}
        if self.replica is not None:
            out["reshard/gen_weights_gb"] = self.replica.weight_bytes / 2**30
        return out
