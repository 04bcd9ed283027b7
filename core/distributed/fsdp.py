"""FSDP2 (``fully_shard``) for the actor, critic and reference models.

``fsdp.sharding_strategy`` maps onto FSDP2 like this:

=============== ===================================== ==============================
strategy        device mesh                           ``reshard_after_forward``
=============== ===================================== ==============================
FULL_SHARD      1-D, all ranks                        True
SHARD_GRAD_OP   1-D, all ranks                        False (weights stay gathered
                                                      from forward to backward)
NO_SHARD        2-D ``(world, 1)``: pure replication  False
HYBRID_SHARD    2-D ``(world / s, s)``: shard inside  True
                groups of ``s`` ranks, replicate
                across groups (``s`` = GPUs per node)
=============== ===================================== ==============================

Each decoder layer is one FSDP unit and the root holds the rest (embeddings, final norm, head).
``use_orig_params`` needs no handling: FSDP2 always exposes the original parameters (as DTensors).
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from rlcore.config.schema import Dtype, FSDPConfig, ShardingStrategy, torch_dtype
from rlcore.errors import ConfigError
from rlcore.protocols import DistInfo

log = logging.getLogger(__name__)

#: sharding_strategy -> reshard_after_forward of the FSDP units.
RESHARD_AFTER_FORWARD = {ShardingStrategy.FULL_SHARD: True, ShardingStrategy.SHARD_GRAD_OP: False,
                         ShardingStrategy.NO_SHARD: False, ShardingStrategy.HYBRID_SHARD: True}
#: Names of the module lists that hold decoder blocks in common architectures.
LAYER_LIST_NAMES = ("layers", "h", "blocks", "block", "decoder_layers")


def check_fsdp_config(fsdp: FSDPConfig, key: str = "fsdp") -> None:
    """Raise :class:`ConfigError` listing every unknown value of ``fsdp``."""
    problems = []
    if fsdp.sharding_strategy not in ShardingStrategy.values():
        problems.append(f"'{key}.sharding_strategy' = {str(fsdp.sharding_strategy)!r}: use one of "
                        f"{', '.join(ShardingStrategy.values())}")
    for name in ("param_dtype", "reduce_dtype"):
        if getattr(fsdp, name) not in Dtype.values():
            problems.append(f"'{key}.{name}' = {str(getattr(fsdp, name))!r}: use one of {', '.join(Dtype.values())}")
    if problems:
        raise ConfigError(problems)


def device_type(dist: DistInfo) -> str:
    return "cuda" if dist.device.type == "cuda" else "cpu"


def hybrid_shard_size(world_size: int) -> int:
    """Shard-group size of HYBRID_SHARD: the processes of one node (``LOCAL_WORLD_SIZE``) when that
    divides the world, else the whole world."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    return local if 0 < local <= world_size and world_size % local == 0 else world_size


def build_mesh(strategy: str, dist: DistInfo, shard_size: Optional[int] = None):
    """The device mesh of ``strategy`` over all ranks (see the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.world_size
    if strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return init_device_mesh(device_type(dist), (world,), mesh_dim_names=("shard",))
    size = 1 if strategy == "NO_SHARD" else (shard_size or hybrid_shard_size(world))
    if size < 1 or world % size:
        raise ConfigError([f"HYBRID_SHARD: shard group size {size} does not divide the world size {world}"])
    return init_device_mesh(device_type(dist), (world // size, size), mesh_dim_names=("replicate", "shard"))


def mixed_precision(fsdp: FSDPConfig):
    """FSDP2 ``MixedPrecisionPolicy``: compute in ``param_dtype``, reduce gradients in ``reduce_dtype``.
    fp32 means "no cast" (the weights' own dtype)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param = None if fsdp.param_dtype == "fp32" else torch_dtype(fsdp.param_dtype)
    reduce = torch_dtype(fsdp.reduce_dtype) if param is not None or fsdp.reduce_dtype != "fp32" else None
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to wrap one by one: classes named in Hugging Face ``_no_split_modules``,
    else the children of the first module list called ``layers``/``h``/``blocks``."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names]
        if found:
            return found
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] in LAYER_LIST_NAMES:
            return list(m)
    return []


def apply_fsdp(model: nn.Module, fsdp: FSDPConfig, dist: DistInfo, mesh=None) -> nn.Module:
    """Shard ``model`` in place with ``fully_shard``: each decoder layer, then the root.

    :param model: a module on ``dist.device`` (full weights; identical on every rank).
    :param fsdp: the role's effective FSDP settings.
    :param dist: this rank.
    :param mesh: a 1-D (shard) or 2-D (replicate, shard) device mesh; default: built from
        ``fsdp.sharding_strategy`` over all ranks.
    :returns: the same module object, now an ``FSDPModule`` whose parameters are DTensor shards.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    check_fsdp_config(fsdp)
    mesh = mesh if mesh is not None else build_mesh(fsdp.sharding_strategy, dist)
    reshard = RESHARD_AFTER_FORWARD[fsdp.sharding_strategy]
    offload = CPUOffloadPolicy(pin_memory=dist.device.type == "cuda") if fsdp.cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, mp_policy=mixed_precision(fsdp), offload_policy=offload)
    layers = decoder_layers(model)
    if not layers:
        log.warning("%s: no decoder layers found; sharding the whole model as one unit", type(model).__name__)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=reshard, **kwargs)
    return model


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """Every ``fully_shard``-ed submodule of ``model`` (root included), in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def gather_units(units: Sequence[nn.Module]) -> None:
    """Gather the full weights of every FSDP unit and keep them gathered through forward passes."""
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    for unit in units:
        unit.unshard()


def release_units(units: Sequence[nn.Module], reshard_after_forward: bool) -> None:
    """Undo :func:`gather_units`: shard again and restore ``reshard_after_forward``."""
    for unit in reversed(units):
        unit.reshard()
        unit.set_reshard_after_forward(reshard_after_forward, recurse=False)


def enable_gradient_checkpointing(model: nn.Module, selective: bool = False) -> nn.Module:
    """Recompute activations in the backward pass, in the non-reentrant form FSDP2 composes with;
    ``selective``: only the pointwise work between the kept matrix products and attention
    (:func:`rlcore.trainer.recompute.selective_contexts`).

    Hugging Face models use their own switch; other models get each decoder layer wrapped.
    """
    kwargs: dict = {"use_reentrant": False}
    if selective:
        from rlcore.trainer.recompute import selective_contexts

        kwargs["context_fn"] = selective_contexts
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return model
    if hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    layers = set(map(id, decoder_layers(model)))
    if not layers:
        raise ConfigError([f"gradient_checkpointing: {type(model).__name__} has no decoder layers to checkpoint"])
    wrap = {}
    if selective:
        from functools import partial

        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        wrap["checkpoint_wrapper_fn"] = partial(checkpoint_wrapper, context_fn=selective_contexts)
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in layers, **wrap)
    return model


def layer_compile_options() -> dict[str, object]:
    """Inductor options of the compiled decoder layers (those this torch build knows):

    * ``triton.mix_order_reduction_non_strict_mode``: keeps one compiled layer valid for every
      micro-batch length. With dynamic shapes, Inductor's fusion of the norms' mixed-order
      reductions (backward) tests the token count against size thresholds and guards on the
      answer, so a micro-batch on the other side of a threshold recompiled every layer (tens of
      seconds in the middle of an update); the non-strict mode fuses without those tests.
    * ``emulate_precision_casts``: fused kernels still round to the compute dtype where the model's
      eager code does (RMSNorm before its weight, the residual adds), so the compiled layers give
      the uncompiled model's values, which the rollout engine rounds alike."""
    try:
        from torch._inductor import config as inductor_config
    except Exception:  # noqa: BLE001 - no Inductor: nothing to set
        return {}
    options: dict[str, object] = {}
    if hasattr(getattr(inductor_config, "triton", None), "mix_order_reduction_non_strict_mode"):
        options["triton.mix_order_reduction_non_strict_mode"] = True
    if hasattr(inductor_config, "emulate_precision_casts"):
        options["emulate_precision_casts"] = True
    return options


#: AOTAutograd settings of the compiled layers' forward/backward split with ``recompute_pointwise``, set
#: while a layer's compiled call runs (the split is made when it compiles):
#: ``ban_recompute_materialized_backward=False`` lets the backward recompute the pointwise results that
#: feed matrix products (the norms' outputs, SiLU·mul) from tensors it keeps anyway instead of saving
#: them: a third less activation memory a layer (Qwen2-1.5B's: 72.1 -> 48.6 KB a token in bf16) for a
#: pointwise pass more in the backward, with the same gradients (bit for bit on CPU,
#: ``tests/integration/test_train_compile.py``; up to bf16 rounding on CUDA, where Inductor fuses the
#: recomputed work into other kernels, ``tests/gpu/test_gpu_compile_pointwise.py``)
PARTITION_SETTINGS = {"ban_recompute_materialized_backward": False}


def _partition_for_memory(layer: nn.Module) -> None:
    """Run ``layer``'s compiled call under :data:`PARTITION_SETTINGS` (those this torch build knows)."""
    import torch._functorch.config as functorch_config

    settings = {k: v for k, v in PARTITION_SETTINGS.items() if hasattr(functorch_config, k)}
    compiled = getattr(layer, "_compiled_call_impl", None)
    if not settings or compiled is None:
        return

    def call(*args, **kwargs):
        with functorch_config.patch(settings):
            return compiled(*args, **kwargs)

    call.compiled = compiled  # the compiled call itself
    layer._compiled_call_impl = call


def compile_layers(model: nn.Module, role: str = "model", fallback: bool = False,
                   recompute_pointwise: bool = False) -> nn.Module:
    """Compile each decoder layer in place with ``torch.compile`` (dynamic shapes: micro-batches
    vary in length), before FSDP wraps the layers, as regional compilation composes with FSDP2
    and activation checkpointing. Inductor fuses the pointwise work between the matrix products
    (norms, rotary embedding, SiLU-gated MLP, residual adds) in the forward and backward passes.

    ``recompute_pointwise`` (``<role>.compile_recompute_pointwise``): the backward recomputes the
    pointwise results that feed matrix products instead of keeping them (:data:`PARTITION_SETTINGS`).

    ``fallback=True`` (compilation chosen by default, not asked for): a model without decoder
    layers stays as it is, and a layer that fails to compile runs eagerly with a warning
    (``torch._dynamo.config.suppress_errors``) instead of stopping the run.

    :raises ConfigError: the model has no decoder layers to compile (without ``fallback``).
    """
    layers = decoder_layers(model)
    if not layers:
        if fallback:
            log.info("%s: no decoder layers found, training uncompiled", role)
            return model
        raise ConfigError([f"{role}.compile: {type(model).__name__} has no decoder layers to compile"])
    if fallback:
        import torch._dynamo

        torch._dynamo.config.suppress_errors = True
    options = layer_compile_options()
    for layer in layers:
        layer.compile(dynamic=True, options=options or None)
        if recompute_pointwise:
            _partition_for_memory(layer)
    log.info("%s: %d decoder layers compiled with torch.compile (the first steps include compiling; "
             "%s.compile=false turns it off)", role, len(layers), role)
    return model


def _load_structure(load_fn: Callable[[], nn.Module]) -> nn.Module:
    """The model of ``load_fn`` without its weights where the loader allows (meta device)."""
    try:
        with torch.device("meta"):
            return load_fn()
    except Exception as e:  # noqa: BLE001 - some loaders refuse the meta device: load for real
        log.debug("loading on the meta device failed (%s); loading normally", e)
        return load_fn()


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    out = []
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


@torch.no_grad()
def broadcast_module(model: nn.Module, src: int = 0) -> None:
    """Overwrite every parameter and buffer with rank ``src``'s values (names must match on every rank)."""
    import torch.distributed as tdist

    for _, t in _tensors(model):
        tdist.broadcast(t.data, src=src)


def load_model_for_role(load_fn: Callable[[], nn.Module], fsdp: FSDPConfig, dist: DistInfo) -> nn.Module:
    """Load one role's model so that every rank holds the same weights, honouring ``fsdp.sync_module_states``.

    * ``sync_module_states: true`` — rank 0 calls ``load_fn()``; the other ranks build the structure
      (on the meta device when the loader allows), then receive every tensor from rank 0.
    * ``sync_module_states: false`` — every rank calls ``load_fn()`` (the same checkpoint path).

    :param load_fn: returns the model on ``dist.device``, e.g.
        ``lambda: load_causal_lm(path, dtype, device)``.
    :returns: the full (not yet sharded) model; hand it to the reshard policy's ``prepare``.
    """
    from rlcore.distributed.init import is_initialized

    if not dist.distributed or not fsdp.sync_module_states or not is_initialized():
        return load_fn()
    if dist.is_main:
        model = load_fn()
    else:
        model = _load_structure(load_fn)
        if any(t.is_meta for _, t in _tensors(model)):
            model = model.to_empty(device=dist.device)
            if hasattr(model, "tie_weights"):
                model.tie_weights()
    names = [n for n, _ in _tensors(model)]
    from rlcore.distributed.init import all_gather_object

    if any(other != names for other in all_gather_object(names)):
        raise ConfigError(["fsdp.sync_module_states: the ranks built models with different parameters; "
                           "every rank must load the same architecture"])
    broadcast_module(model, src=0)
    return model
