"""The software stack a prediction prices: what it keeps in memory, what it sends, what it overlaps.

The same layout costs differently under different stacks (Megatron-LM's distributed optimizer keeps
bf16 weights and reduce-scatters fp32 gradients once per step; this project's executor runs FSDP2 with
fp32 master weights and reduce-scatters every micro-batch under ZeRO 2/3). A :class:`Framework` is the
set of such behaviours; :data:`FRAMEWORKS` names the profiles a user picks with ``--framework``.
``paraplan`` — what ``paraplan execute`` really does, checked by its dry run — is the default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .compute import ATTENTION_KERNELS
from .errors import PlanError


@dataclass(frozen=True)
class Framework:
    name: str
    attention: str = "flash"  # fused SDPA / FlashAttention, or Megatron 2021-22's unfused kernels with dropout
    overlap_dp: bool = True  # gradient reduction overlapped with the backward where the stack can
    overlap_tp: bool = False  # TP all-reduce of input gradients hidden behind weight-gradient GEMMs (Megatron)
    # Model states: "executor" = FSDP2 mixed precision (fp32 master weights sharded by ZeRO 3 and 2, a bf16
    # copy for compute, fp32 gradients, Adam's two fp32 moments); "zero" = ZeRO's accounting (Rajbhandari
    # et al. 2020: 2 + 2 + 12 bytes per parameter, sharded by the stage).
    states: str = "executor"
    grad_bytes: int = 4  # bytes per gradient element reduced in 16-bit training (4: fp32 reduction)
    # Data-parallel gradient sync with a pipeline: "end" = after the pipeline's last backward, exposed
    # (torch.distributed.pipelining's REDUCE_GRAD); "overlap" = during the last micro-batch's backward.
    dp_sync_pipelined: str = "end"
    zero1: str = "allreduce+broadcast"  # or "reduce_scatter+all_gather" (Megatron's distributed optimizer)
    zero23_every_micro_batch: bool = True  # ZeRO 2/3 reduce-scatter each micro-batch (executor, DeepSpeed)
    sp_saves_gathered_input: bool = True  # SP regions keep their gathered input for backward (DTensor)
    p2p_scatter_gather: bool = False  # without SP a pipeline send carries 1/t of the boundary (Megatron)
    embedding_sp_reduce: str = "all_reduce"  # the vocab-parallel embedding's output under SP (or reduce_scatter)
    source: str = ""

    def replace(self, **changes) -> Framework:
        return dataclasses.replace(self, **changes)

    @property
    def runs_on_executor(self) -> bool:
        return self.states == "executor"


PARAPLAN = Framework(
    name="paraplan",
    source="executor/data_parallel.py, pipeline.py, tensor_parallel.py (checked by execute --dry-run)")

MEGATRON_2021 = Framework(
    name="megatron-2021", attention="unfused", overlap_dp=False, overlap_tp=True, states="zero", grad_bytes=2,
    dp_sync_pipelined="overlap", zero1="reduce_scatter+all_gather", zero23_every_micro_batch=False,
    sp_saves_gathered_input=False, p2p_scatter_gather=True, embedding_sp_reduce="reduce_scatter",
    source="Narayanan et al. 2021 (SC21) and Korthikanti et al. 2022: Megatron-LM with unfused attention "
           "and dropout, fp16 gradients all-reduced after the pipeline flush, scatter/gather P2P")

FRAMEWORKS = {f.name: f for f in (PARAPLAN, MEGATRON_2021)}


def framework(profile: str | Framework, attention: str | None = None, overlap_dp: bool | None = None,
              overlap_tp: bool | None = None) -> Framework:
    """The named profile (or the given one) with explicit switches on top (``--attention``,
    ``--overlap-dp``, ``--overlap-tp``)."""
    if isinstance(profile, Framework):
        fw = profile
    elif profile in FRAMEWORKS:
        fw = FRAMEWORKS[profile]
    else:
        raise PlanError(f"unknown framework {profile!r} (one of {', '.join(FRAMEWORKS)})")
    changes = {k: v for k, v in (("attention", attention), ("overlap_dp", overlap_dp), ("overlap_tp", overlap_tp))
               if v is not None}
    if changes.get("attention", fw.attention) not in ATTENTION_KERNELS:
        raise PlanError(f"attention kernel must be one of {', '.join(ATTENTION_KERNELS)}")
    return fw.replace(**changes) if changes else fw
