"""Placement policies: which device each role uses in this process."""

from __future__ import annotations

from typing import Sequence

import torch

from rlcore.errors import PlacementError
from rlcore.protocols import ROLES, DistInfo, PlacementRequest


def parse_device(spec: str, local: torch.device) -> torch.device:
    """Turn ``auto`` / ``cpu`` / ``cuda`` / ``cuda:N`` into a device, checking that it exists."""
    if spec in ("auto", "", None):
        return local
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError) as e:
        raise PlacementError(f"'{spec}' is not a device (use auto, cpu, cuda or cuda:N)") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise PlacementError(f"device '{spec}' was asked for but no CUDA GPU is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise PlacementError(f"device '{spec}' was asked for but this machine has "
                                 f"{torch.cuda.device_count()} GPU(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
        if dev.index is None:
            dev = local if local.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return dev


class ColocatedPlacement:
    """Every role on every rank, on the device given per role (default: this rank's device)."""

    def __init__(self, request: PlacementRequest, dist: DistInfo):
        self.request = request
        self.dist = dist
        self._devices = {role: parse_device(getattr(request, role), dist.device) for role in ROLES}
        for role, ranks in request.rank_groups.items():
            if role not in ROLES:
                raise PlacementError(f"unknown role '{role}' in placement rank groups (roles: {', '.join(ROLES)})")
            bad = [r for r in ranks if not 0 <= r < dist.world_size]
            if bad:
                raise PlacementError(f"role '{role}' placed on ranks {bad}, but the world size is {dist.world_size}")

    def device_for(self, role: str) -> torch.device:
        if role not in self._devices:
            raise PlacementError(f"unknown role '{role}' (roles: {', '.join(ROLES)})")
        return self._devices[role]

    def ranks_for(self, role: str) -> Sequence[int]:
        return list(self.request.rank_groups.get(role, range(self.dist.world_size)))

    def offload(self, role: str) -> bool:
        return role == "reward" and self.request.reward_offload
