"""What this machine offers a plan: the device kind, process slots per node, and free ports.

A plan made for a cluster whose GPU spec is ``cpu`` (the ``local`` cluster) runs as CPU processes
with gloo, one per "GPU" slot of the cluster; any other cluster means CUDA GPUs with nccl, one
process per GPU, and this node must have that many.
"""

from __future__ import annotations

import errno
import os
import socket

from paraplan.hardware_specs import ClusterSpec, HardwareSpecError
from paraplan.planner.plan import Plan

from .errors import ExecutionError


def plan_cluster(plan: Plan) -> ClusterSpec | None:
    """The plan's cluster spec, or None where this machine does not know it."""
    try:
        return plan.load_cluster()
    except HardwareSpecError:
        return None


def plan_device_type(plan: Plan) -> str:
    cluster = plan_cluster(plan)
    if cluster is not None:
        return "cpu" if cluster.gpu.is_cpu else "cuda"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def rank_device(plan: Plan) -> tuple:
    """(torch.device, backend) of this rank: its node-local GPU with nccl, or the CPU with gloo."""
    import torch

    if plan_device_type(plan) == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def check_slots(plan: Plan, world_size: int, nnodes: int) -> int:
    """Processes per node for ``world_size`` ranks on ``nnodes`` nodes; refuses what cannot run here."""
    if world_size % nnodes:
        raise ExecutionError(f"the plan's {world_size} ranks do not split evenly over --nnodes {nnodes}")
    per_node = world_size // nnodes
    device = plan_device_type(plan)
    if device == "cuda":
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have == 0:
            raise ExecutionError(f"the plan is for cluster {plan.cluster} (GPUs), but this machine has no CUDA GPU")
        if per_node > have:
            raise ExecutionError(f"the plan needs {per_node} GPUs on this node ({world_size} ranks over {nnodes} "
                                 f"node{'s' if nnodes > 1 else ''}), but it has {have}")
        return per_node
    cluster = plan_cluster(plan)
    if cluster is not None:
        slots = cluster.gpus_per_node * cluster.nodes
        if world_size > slots:
            raise ExecutionError(f"the plan needs {world_size} ranks, but cluster {cluster.name} has {slots} "
                                 "process slots")
    return per_node


def check_port_free(addr: str, port: int) -> None:
    """Refuse a rendezvous port another program holds (before torchrun fails on it less clearly)."""
    if not 0 < port < 65536:
        raise ExecutionError(f"--master-port {port} is not a TCP port (1-65535)")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free; a listener is not
        _bind(s, addr, port)


def free_port(addr: str) -> int:
    """A port the rendezvous can take on ``addr`` (one of this machine's addresses: a single node hosts it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        _bind(s, addr, 0)
        return s.getsockname()[1]


def _bind(s: socket.socket, addr: str, port: int) -> None:
    """Bind ``s`` to ``addr``:``port``, a refusal as the user's one-line error."""
    try:
        s.bind((_bind_host(addr), port))
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ExecutionError(f"port {port} on {addr} is in use; pick another --master-port") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise ExecutionError(f"--master-addr {addr} is not an address of this machine (node rank 0 "
                                 "hosts the rendezvous)") from None
        raise ExecutionError(f"cannot use port {port} on {addr}: {e.strerror}") from None


def _bind_host(addr: str) -> str:
    try:
        return socket.gethostbyname(addr)
    except OSError:
        raise ExecutionError(f"cannot resolve --master-addr {addr}") from None
