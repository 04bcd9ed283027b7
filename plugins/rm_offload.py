"""``rm-offload``: keep the reward model off the actor's GPU.

Answers ``rlcore_reward_backend`` when ``reward_model.enable``; function rewards work as in the default
backend. Where the reward model lives follows ``reward_model.device`` and ``reward_model.offload``
(as resolved by the placement policy):

======================  ===================  ==============================================================
device                  offload              reward model
======================  ===================  ==============================================================
``cpu``                 any                  on the CPU, scores there (no GPU memory at all)
``cuda:N`` / ``cuda``   false                resident on that GPU (its own GPU when it is not the actor's)
``cuda:N`` / ``cuda``   true                 *swapped*: weights in pinned CPU memory, copied to that GPU
                                             only while scoring, released afterwards
``auto``                false                a GPU no local rank uses, if there is one; else swapped onto
                                             the actor's GPU; CPU on a machine without GPU
``auto``                true                 swapped onto the actor's GPU
======================  ===================  ==============================================================

Swapping copies the weights layer by layer on a side CUDA stream with ``non_blocking`` copies from
pinned memory; each layer waits only for its own copy, so the copy overlaps the tokenization of the
batch and the compute of the layers already there. Released blocks go back to PyTorch's caching
allocator, where the actor's next allocations reuse them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from rlcore.hookspecs import hookimpl
from rlcore.rewards.base import ComponentResult

log = logging.getLogger(__name__)

MODES = ("cpu", "gpu", "swap")


@dataclass(frozen=True)
class RMPlacement:
    """Where the reward model rests and computes."""

    #: ``cpu`` (rests and computes on the CPU) | ``gpu`` (resident on ``device``) | ``swap`` (rests in pinned
    #: CPU memory, computes on ``device``).
    mode: str
    #: The device that computes.
    device: torch.device
    #: Why, in words (logged at start-up).
    reason: str


def plan_placement(spec: str, offload: bool, reward_device: torch.device, actor_device: torch.device,
                   gpu_count: int, local_world_size: int = 1) -> RMPlacement:
    """Decide the reward model's placement (a pure function: no device is touched).

    :param spec: ``reward_model.device`` as written (``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``).
    :param offload: whether the reward model's weights rest in CPU memory between uses.
    :param reward_device: the placement policy's device for the reward role (already validated).
    :param actor_device: the placement policy's device for the actor.
    :param gpu_count: GPUs visible to this process.
    :param local_world_size: processes on this machine, each assumed to use one GPU from ``cuda:0`` up.
    """
    if reward_device.type == "cpu":
        why = "reward_model.device=cpu" if spec == "cpu" else "no GPU for the reward role"
        return RMPlacement("cpu", torch.device("cpu"), why + ": the reward model lives and scores on the CPU")
    if offload:
        return RMPlacement("swap", reward_device, f"reward_model.offload=true: weights rest in pinned CPU memory "
                                                  f"and move to {reward_device} only while scoring")
    if spec not in ("auto", "", None):
        own = "its own GPU" if reward_device != actor_device else "the actor's GPU"
        return RMPlacement("gpu", reward_device, f"reward_model.device={spec}: resident on {reward_device} ({own})")
    used = {actor_device.index or 0} | set(range(local_world_size))
    free = [i for i in range(gpu_count) if i not in used]
    if free:
        dev = torch.device("cuda", free[0])
        return RMPlacement("gpu", dev, f"reward_model.device=auto: resident on {dev}, a GPU no local rank uses")
    return RMPlacement("swap", reward_device, f"reward_model.device=auto and no free GPU: weights rest in pinned "
                                              f"CPU memory and move to {reward_device} only while scoring")


class SwappedScorer:
    """The reward component of a model whose weights rest in (pinned) CPU memory and visit ``device`` to score.

    Works with ``device=cpu`` too (the copies are then plain CPU copies), which lets the swap path run
    without a GPU.
    """

    name = "rm"

    def __init__(self, rm: Any, device: torch.device, pin: Optional[bool] = None):
        self.rm, self.device = rm, torch.device(device)
        self.cuda = self.device.type == "cuda"
        pin = self.cuda if pin is None else pin
        module = rm.module.to("cpu")
        self._groups = _tensor_groups(module)
        for group in self._groups:
            for slot in group:
                if pin:
                    slot.set(slot.get().pin_memory())
                slot.home = slot.get()
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._pending: dict[int, Any] = {}
        self._handles = [layer.register_forward_pre_hook(self._wait_hook(k + 1))
                         for k, layer in enumerate(_layers(module))]
        self.on_gpu = False

    def _wait_hook(self, group: int) -> Any:
        def hook(_module: Any, _args: Any) -> None:
            event = self._pending.get(group)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
        return hook

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """Weights on ``device`` inside the block (copy started on entry, layer by layer), back home after."""
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        if self.cuda:
            self._copy_stream.wait_stream(compute)
        try:
            for k, group in enumerate(self._groups):
                targets = [torch.empty_like(slot.home, device=self.device) for slot in group]  # compute stream
                with torch.cuda.stream(self._copy_stream) if self.cuda else contextlib.nullcontext():
                    for slot, dst in zip(group, targets):
                        dst.copy_(slot.home, non_blocking=self.cuda)
                        slot.set(dst)
                    if self.cuda:
                        self._pending[k] = torch.cuda.Event()
                        self._pending[k].record(self._copy_stream)
            if self.cuda:  # embeddings, final norm and head (group 0) are needed first and last
                compute.wait_event(self._pending[0])
            self.on_gpu = True
            yield
        finally:
            if self.cuda:  # copies must finish before their targets are freed
                compute.wait_stream(self._copy_stream)
            for group in self._groups:
                for slot in group:
                    slot.set(slot.home)
            self._pending.clear()
            self.on_gpu = False

    def __call__(self, batch: Any) -> ComponentResult:
        t = time.perf_counter()
        with self.on_device():
            seqs, truncated = self.rm.encode(batch)  # CPU work while the weights travel
            scores = self.rm.forward(seqs, self.device)
        return ComponentResult(scores=scores.tolist(), metrics={
            "reward/rm_truncated": float(truncated), "time/reward_model_s": time.perf_counter() - t})


class _Slot:
    """One parameter or buffer whose storage is switched between home (CPU) and the compute device."""

    __slots__ = ("module", "name", "param", "home")

    def __init__(self, module: torch.nn.Module, name: str, param: Optional[torch.nn.Parameter]):
        self.module, self.name, self.param, self.home = module, name, param, None

    def get(self) -> torch.Tensor:
        return self.param.data if self.param is not None else self.module._buffers[self.name]

    def set(self, t: torch.Tensor) -> None:
        if self.param is not None:
            self.param.data = t
        else:
            self.module._buffers[self.name] = t


def _layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks: the longest ``ModuleList`` (the decoder layers)."""
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _tensor_groups(module: torch.nn.Module) -> list[list[_Slot]]:
    """Parameters and buffers grouped for copying: group 0 = outside the layers, group k = layer k-1."""
    layers = _layers(module)
    owner = {id(sub): k + 1 for k, layer in enumerate(layers) for sub in layer.modules()}
    groups: list[list[_Slot]] = [[] for _ in range(len(layers) + 1)]
    seen: set[int] = set()
    for mod in module.modules():
        g = owner.get(id(mod), 0)
        for name, p in mod.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                groups[g].append(_Slot(mod, name, p))
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                groups[g].append(_Slot(mod, name, None))
    return groups


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@hookimpl
def rlcore_preflight(config):
    if not config["reward_model"]["enable"]:
        log.warning("plugin 'rm-offload' is selected but does nothing in this run: reward_model.enable is false "
                    "(no reward model to place)")


@hookimpl
def rlcore_reward_backend(reward_model, reward_function, reward, placement, tokenizer, rewards):
    if not reward_model.enable:
        return None
    from rlcore.distributed.placement import parse_device
    from rlcore.rewards.backend import assemble_backend
    from rlcore.rewards.reward_model import ResidentScorer, RewardModel

    actor = placement.device_for("actor")
    parse_device(reward_model.device, actor, "reward_model.device")  # PlacementError now for e.g. cuda:4 on a one-GPU machine
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", len(placement.ranks_for("actor")) or 1))
    plan = plan_placement(reward_model.device, placement.offload("reward"), placement.device_for("reward"),
                          actor, _gpu_count(), local_world)
    log.info("rm-offload: %s", plan.reason)

    def rm_factory() -> Any:
        rm = RewardModel.load(reward_model, tokenizer)
        if plan.mode == "swap":
            return SwappedScorer(rm, plan.device)
        return ResidentScorer(rm, plan.device)

    backend = assemble_backend(reward_function, reward, rewards, rm_factory)
    backend.rm_placement = plan
    return backend
