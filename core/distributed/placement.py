"""Placement: which ranks hold each role (actor, critic, ref, reward) and which device it uses there.

The default keeps every role on every rank (colocated). ``PlacementRequest.rank_groups`` splits
roles over pools of ranks instead, e.g. ``{"actor": [0, 1, 2], "critic": [0, 1, 2], "reward": [3]}``:
a role named there lives only on its ranks, a role not named stays on every rank. The request is
checked against the world size when the policy is built, and every problem is reported at once.

The trainer accepts a split of the ``reward`` role only (:func:`check_trainer_placement`): actor,
critic and ref train, or are sharded like the actor, with FSDP over every rank.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Optional, Sequence

import torch

from rlcore.errors import PlacementError
from rlcore.protocols import ROLES, DistInfo, PlacementRequest


log = logging.getLogger(__name__)

#: the config key that sets each role's device
DEVICE_KEYS = {"actor": "actor.device", "critic": "critic.device", "ref": "actor.device",
               "reward": "reward_model.device"}


def requested_devices(actor: Any, critic: Any, reward_model: Any, uses_critic: bool) -> dict[str, str]:
    """Each role's device setting from the config sections. A role the run does not have (no critic
    under GRPO/RLOO, no reward model unless enabled) keeps ``"auto"``: its setting is inert, as the
    start-up warning says, and is not checked."""
    return {"actor": actor.device, "critic": critic.device if uses_critic else "auto", "ref": actor.device,
            "reward": reward_model.device if reward_model.enable else "auto"}


def parse_device(spec: str, local: torch.device, key: str = "device") -> torch.device:
    """Turn ``auto`` / ``cpu`` / ``cuda`` / ``cuda:N`` into a device, checking that it exists
    (errors name the config ``key``)."""
    if spec in ("auto", "", None):
        return local
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError) as e:
        raise PlacementError(f"{key}='{spec}' is not a device (use auto, cpu, cuda or cuda:N)") from e
    if dev.type not in ("cpu", "cuda"):
        raise PlacementError(f"{key}='{spec}': device type '{dev.type}' is not supported (use auto, cpu, cuda "
                             "or cuda:N)")
    if dev.type == "cpu" and dev.index not in (None, 0):
        raise PlacementError(f"{key}='{spec}': there is one CPU device (use cpu)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise PlacementError(f"{key}='{spec}' asks for a CUDA GPU, but none is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise PlacementError(f"{key}='{spec}' asks for a GPU this machine does not have: it has "
                                 f"{torch.cuda.device_count()} GPU(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
        if dev.index is None:
            dev = local if local.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return dev


def warn_shared_gpu(request: PlacementRequest, dist: DistInfo) -> None:
    """Warn (once per node) when a role's device names one GPU (``cuda:N``) while several processes of
    this node hold that role: each of them would put its copy on that same GPU."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if local < 2 or dist.local_rank != 0:
        return
    groups = request.rank_groups or {}
    for role in ("actor", "critic", "reward"):
        spec = str(getattr(request, role))
        if not spec.startswith("cuda:"):
            continue
        if role in groups and len(groups[role]) < 2:
            continue  # one process holds it: a chosen GPU is what the user wants
        log.warning("%s='%s' puts the %s on the same GPU in each of the %d processes of this node; use 'auto' "
                    "(each process its own GPU)%s", DEVICE_KEYS[role], spec, role, local,
                    ", or placement.rank_groups.reward to give the reward model its own ranks" if role == "reward"
                    else "")


def check_rank_groups(groups: Mapping[str, Sequence[int]], world_size: int) -> dict[str, list[int]]:
    """Validate role -> ranks pools against ``world_size``; return them as sorted lists.

    :raises PlacementError: listing every unknown role, empty pool, non-integer or out-of-range
        rank, repeated rank, and every rank left without any role.
    """
    problems: list[str] = []
    out: dict[str, list[int]] = {}
    for role, ranks in groups.items():
        if role not in ROLES:
            problems.append(f"unknown role '{role}' in placement rank groups (roles: {', '.join(ROLES)})")
            continue
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            problems.append(f"role '{role}': rank group must be a list of ranks, got {ranks!r}")
            continue
        bad_type = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)]
        if bad_type:
            problems.append(f"role '{role}': ranks must be integers, got {bad_type}")
            continue
        if not ranks:
            problems.append(f"role '{role}': empty rank group (leave the role out to keep it on every rank)")
        out_of_range = sorted(r for r in ranks if not 0 <= r < world_size)
        if out_of_range:
            problems.append(f"role '{role}' placed on ranks {out_of_range}, but the world size is {world_size} "
                            f"(ranks 0..{world_size - 1})")
        if len(set(ranks)) != len(ranks):
            problems.append(f"role '{role}': rank group {list(ranks)} repeats a rank")
        out[role] = sorted(set(ranks))
    if groups and not problems:
        everywhere = [r for r in ROLES if r not in out]
        idle = [r for r in range(world_size) if not everywhere and not any(r in g for g in out.values())]
        if idle:
            problems.append(f"rank(s) {idle} hold no role; give every rank of the {world_size} a role "
                            "or start fewer processes")
    if problems:
        raise PlacementError("invalid placement:\n" + "\n".join(f"  - {p}" for p in problems))
    return out


class ColocatedPlacement:
    """The default placement policy: every role on every rank, on the device given per role
    (default: this rank's device); with ``request.rank_groups``, roles split over rank pools.

    :param request: devices per role and optional rank pools.
    :param dist: this rank and the world size.
    :raises PlacementError: a device that does not exist or pools that do not fit the world.
    """

    def __init__(self, request: PlacementRequest, dist: DistInfo):
        self.request = request
        self.dist = dist
        self._devices = {role: parse_device(getattr(request, role), dist.device, DEVICE_KEYS[role])
                         for role in ROLES}
        warn_shared_gpu(request, dist)
        # One process holds every role: rank pools describe a multi-process layout and are ignored
        # here (the run logs the key as inert), so one config serves a one-process debug run too.
        self._groups = check_rank_groups(request.rank_groups, dist.world_size) if dist.world_size > 1 else {}
        self._process_groups: dict[str, Any] = {}

    @property
    def split(self) -> bool:
        """True when some role lives on a subset of the ranks."""
        return any(len(g) < self.dist.world_size for g in self._groups.values())

    def _check_role(self, role: str) -> None:
        if role not in ROLES:
            raise PlacementError(f"unknown role '{role}' (roles: {', '.join(ROLES)})")

    def device_for(self, role: str) -> torch.device:
        """The device ``role`` computes on in this process (asking on a rank without the role is an error)."""
        self._check_role(role)
        if not self.holds(role):
            raise PlacementError(f"role '{role}' is not placed on rank {self.dist.rank} "
                                 f"(its ranks: {self.ranks_for(role)})")
        return self._devices[role]

    def ranks_for(self, role: str) -> Sequence[int]:
        """The global ranks that hold ``role``."""
        self._check_role(role)
        return list(self._groups.get(role, range(self.dist.world_size)))

    def holds(self, role: str) -> bool:
        """Whether this rank holds ``role``."""
        return self.dist.rank in self.ranks_for(role)

    def offload(self, role: str) -> bool:
        """Whether ``role``'s weights rest in CPU memory between uses (the reward model with ``reward_offload``)."""
        self._check_role(role)
        return role == "reward" and self.request.reward_offload

    def process_group(self, role: str) -> Optional[Any]:
        """The process group of ``role``'s ranks (None = the default group of all ranks).

        Every rank must call this for the same roles in the same order the first time (groups are
        created collectively); later calls return the cached group.
        """
        ranks = self.ranks_for(role)
        if len(ranks) == self.dist.world_size:
            return None
        key = ",".join(map(str, ranks))
        if key not in self._process_groups:
            import torch.distributed as tdist

            self._process_groups[key] = tdist.new_group(ranks=ranks)
        return self._process_groups[key]

    def describe(self) -> dict[str, list[int]]:
        """``role -> ranks`` for every role (for logs)."""
        return {role: list(self.ranks_for(role)) for role in ROLES}


#: Roles the trainer keeps on every rank: the actor and critic train with FSDP over all ranks, and
#: the reference policy is sharded like the actor.
FULL_WORLD_ROLES = ("actor", "critic", "ref")


def check_trainer_placement(placement: Any, world_size: int) -> None:
    """Refuse a layout the trainer cannot run: any of :data:`FULL_WORLD_ROLES` on a subset of the ranks.

    :param placement: a built placement policy (its ``ranks_for`` is read).
    :raises PlacementError: naming each such role, its ranks, and why only ``reward`` can be split.
    """
    partial = {r: list(placement.ranks_for(r)) for r in FULL_WORLD_ROLES}
    partial = {r: ranks for r, ranks in partial.items() if len(ranks) != world_size}
    if not partial:
        return
    lines = [f"placement.rank_groups.{r} = {ranks} puts '{r}' on {len(ranks)} of the {world_size} ranks"
             for r, ranks in partial.items()]
    raise PlacementError(
        "invalid placement:\n" + "\n".join(f"  - {line}" for line in lines) + "\n"
        "Only the 'reward' role can be split over ranks in this version: actor and critic train with FSDP "
        "over every rank and the reference policy is sharded like the actor, so each must be on all ranks. "
        "Remove them from placement.rank_groups (or list every rank).")
