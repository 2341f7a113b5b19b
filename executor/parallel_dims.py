"""The degrees of a run and the DeviceMesh they make (torchtitan's ParallelDims, in small).

Ranks are laid out pipeline-outermost, tensor-innermost, exactly as the planner places them
(planner/placement.py): ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``. The mesh has the named
axes ``("pp", "dp", "tp")`` in that order, so a row-major mesh reproduces that numbering and a
tensor-parallel group is a run of consecutive ranks (one node, when tp <= GPUs per node).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from .errors import ExecutionError

MESH_AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        for name in MESH_AXES:
            if getattr(self, name) < 1:
                raise ExecutionError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of global rank ``rank``."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ExecutionError(f"the plan needs dp x tp x pp = {self.dp} x {self.tp} x {self.pp} = "
                                 f"{self.world_size} ranks, but {world_size} were launched")

    def build_mesh(self, device_type: str, timeout: timedelta | None = None):
        """The 3-D DeviceMesh (pp, dp, tp) over the default process group; every axis' group gets
        ``timeout``, so a collective waiting on a dead or hung peer fails instead of hanging."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_AXES)
        if timeout is not None:
            for axis in MESH_AXES:
                set_group_timeout(mesh[axis].get_group(), timeout)
            set_group_timeout(dist.group.WORLD, timeout)
        return mesh


def set_group_timeout(group, timeout: timedelta) -> None:
    """Give a process group the run's timeout (DeviceMesh creates its groups with torch's default)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)
