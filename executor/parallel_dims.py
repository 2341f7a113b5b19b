"""The degrees of a run and the DeviceMesh they make (torchtitan's ParallelDims, in small).

Ranks are laid out pipeline-outermost, tensor-innermost, as the planner places them
(planner/placement.py), with the context-parallel ranks of a sequence between the data- and the
tensor-parallel ones: ``rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))`` (with cp = 1,
``tp_rank + tp * (dp_rank + dp * pp_rank)``). The mesh has the named axes ``("pp", "dp", "cp", "tp")`` in
that order, so a row-major mesh reproduces that numbering and a tensor-parallel group is a run of
consecutive ranks (one node, when tp <= GPUs per node).

Experts fold onto the same ranks (Megatron-Core's MoE parallel folding): within a pipeline stage the
index ``i = tp_rank + tp * (cp_rank + cp * dp_rank)`` over its dp x cp x tp ranks splits as expert tensor
parallelism innermost, then expert parallelism, then expert data parallelism (edp = dp·cp·tp / (ep·etp)):
``etp_rank = i % etp``, ``ep_rank = (i // etp) % ep``, ``edp_rank = i // (etp * ep)``. The expert mesh
``("pp", "edp", "ep", "etp")`` is the main mesh with its dp, cp and tp axes flattened and cut again that
way (one root mesh, so FSDP2 can shard expert DTensors over edp).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from .errors import ExecutionError

MESH_AXES = ("pp", "dp", "cp", "tp")
EXPERT_AXES = ("edp", "ep", "etp")


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        for name in (*MESH_AXES, "ep", "etp"):
            if getattr(self, name) < 1:
                raise ExecutionError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.stage_size % (self.ep * self.etp):
            raise ExecutionError(f"ep x etp = {self.ep * self.etp} must divide a stage's dp x cp x tp = "
                                 f"{self.stage_size} ranks")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: dp x cp x tp."""
        return self.dp * self.cp * self.tp

    @property
    def edp(self) -> int:
        """Expert data parallelism: the ranks of a stage holding the same expert shard."""
        return self.stage_size // (self.ep * self.etp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of global rank ``rank``."""
        return rank // self.stage_size, (rank // (self.tp * self.cp)) % self.dp, rank % self.tp

    def cp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.cp

    def expert_coords(self, rank: int) -> tuple[int, int, int]:
        """(edp_rank, ep_rank, etp_rank) of global rank ``rank`` (the folding in the module docstring)."""
        i = rank % self.stage_size
        return i // (self.etp * self.ep), (i // self.etp) % self.ep, i % self.etp

    def rank(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            cp = f" x cp {self.cp}" if self.cp > 1 else ""
            raise ExecutionError(f"the plan needs dp x tp x pp{cp} = {self.dp} x {self.tp} x {self.pp} = "
                                 f"{self.world_size} ranks, but {world_size} were launched")

    def build_mesh(self, device_type: str, timeout: timedelta | None = None):
        """The 4-D DeviceMesh (pp, dp, cp, tp) over the default process group; every axis' group gets
        ``timeout``, so a collective waiting on a dead or hung peer fails instead of hanging."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (self.pp, self.dp, self.cp, self.tp), mesh_dim_names=MESH_AXES)
        if timeout is not None:
            for axis in MESH_AXES:
                set_group_timeout(mesh[axis].get_group(), timeout)
            set_group_timeout(dist.group.WORLD, timeout)
        return mesh

    def data_mesh(self, mesh, timeout: timedelta | None = None):
        """The 1-D mesh gradients are averaged over: dp, or dp x cp flattened (each cp rank trains other tokens
        of the same samples). Collective the first time (every rank calls it, in the same order)."""
        if self.cp == 1:
            return mesh["dp"]
        flat = mesh["dp", "cp"]._flatten("dp_cp")
        if timeout is not None:
            set_group_timeout(flat.get_group(), timeout)
        return flat

    def expert_mesh(self, mesh, timeout: timedelta | None = None):
        """The 3-D mesh (edp, ep, etp) of this rank's stage, cut from ``mesh`` (see the module docstring).
        Collective the first time."""
        stage = mesh["dp", "cp", "tp"]._flatten("dp_cp_tp")
        expert = stage._unflatten(0, (self.edp, self.ep, self.etp), EXPERT_AXES)
        if timeout is not None:
            for axis in EXPERT_AXES:
                set_group_timeout(expert[axis].get_group(), timeout)
        return expert


def set_group_timeout(group, timeout: timedelta) -> None:
    """Give a process group the run's timeout (DeviceMesh creates its groups with torch's default)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)
