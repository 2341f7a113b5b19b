"""What the profiler produces: per-block records and the ModelProfile the planner consumes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Collective:
    """One tensor-parallel collective a block issues per micro-batch: ``op`` over the tp group."""

    op: str  # all_reduce | all_gather | reduce_scatter
    phase: str  # fwd | bwd
    bytes: int  # size of the full (unsharded) tensor the collective produces or reduces
    what: str = ""


@dataclass
class TPView:
    """One block on one rank of a ``tp``-way tensor-parallel group (without / with sequence parallelism)."""

    tp: int
    fwd_flops: int
    bwd_flops: int
    param_bytes: int
    activation_bytes: int  # saved for backward on one rank, without sequence parallelism
    activation_bytes_sp: int  # the same with sequence parallelism (replicated parts split over the sequence)
    collectives: list[Collective]
    collectives_sp: list[Collective]


@dataclass
class OpMix:
    """The kernels of one pass of a block, as the cost model needs them.

    ``gemm_flops`` lists each matmul-like kernel's FLOPs (its efficiency depends on its size);
    ``other_bytes`` is the memory traffic of everything else (elementwise, norms, softmax);
    ``kernels`` counts kernels that really run (views are free). ``*_sharded`` are the parts a
    tensor-parallel rank splits over its group.
    """

    gemm_flops: list[int] = field(default_factory=list)
    gemm_sharded: list[bool] = field(default_factory=list)
    gemm_core: list[bool] = field(default_factory=list)  # inside softmax(QK^T)V (selective recompute)
    other_bytes: int = 0
    other_bytes_sharded: int = 0
    other_bytes_core: int = 0
    other_bytes_fixed: int = 0  # of other_bytes, the part that does not grow with the micro-batch (weight-sized)
    kernels: int = 0
    kernels_core: int = 0
    core_scores_bytes: int = 0  # the attention score matrix (b, a, s, s): what a fused softmax reads and writes
    # Mixture of experts: per GEMM, 0 outside an MoE block, 1 inside it (router, dispatch, shared experts), 2 in
    # its routed experts (what expert parallelism regroups); the bytes moved and kernels run inside each.
    gemm_moe: list[int] = field(default_factory=list)
    other_bytes_moe: int = 0  # inside MoE blocks, routed experts included
    other_bytes_expert: int = 0  # inside the routed experts
    kernels_moe: int = 0
    kernels_expert: int = 0
    # The layer's MLP sublayer (its dense MLP or MoE block, ``layers.N.mlp``/``.moe``): per GEMM whether it runs
    # there, and the bytes moved and kernels run there — what MLP recomputation (``--recompute mlp``) repeats.
    gemm_mlp: list[bool] = field(default_factory=list)
    other_bytes_mlp: int = 0
    kernels_mlp: int = 0
    # The attention's prologue (models.in_attention_prologue: MLA's up-projection, Qwen3's query/key norms): its
    # GEMMs (also in gemm_flops), the bytes moved and kernels run there — what selective recomputation repeats
    # besides the attention core.
    prologue_gemm_flops: list[int] = field(default_factory=list)
    prologue_gemm_sharded: list[bool] = field(default_factory=list)
    other_bytes_prologue: int = 0
    kernels_prologue: int = 0


@dataclass
class LayerProfile:
    name: str
    kind: str
    params: int
    param_bytes: int
    fwd_flops: int
    bwd_flops: int
    activation_bytes: int
    output_bytes: int
    input_bytes: int
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    peak_memory_bytes: int | None = None
    signature: str = ""
    tied_params: int = 0  # parameters shared with an earlier block (a tied LM head's weight)
    param_bytes_sharded: int = 0  # what a tensor-parallel rank splits over its group
    activation_bytes_sharded: int = 0
    activation_bytes_selective: int = 0  # saved when the attention core is recomputed (Korthikanti Sec. 5)
    activation_bytes_selective_sharded: int = 0
    region_io: list[tuple[str, int, int, int]] = field(default_factory=list)
    # Mixture of experts: the block's routed-expert parameters (what expert parallelism shards), and those a
    # token does not use ((E - k)/E of them); both 0 for dense blocks. Active parameters = params - inactive.
    expert_params: int = 0
    inactive_params: int = 0
    moe_params: int = 0  # all parameters of the block's MoE blocks: router, routed and shared experts
    activation_bytes_moe: int = 0  # of activation_bytes (and of the selective ones), saved inside MoE blocks
    # Of activation_bytes, what recomputing the MLP sublayer drops: the tensors it saves that it produced
    # itself (its input, produced before it, is kept as the checkpoint's); 0 when not traced (= no saving).
    mlp_dropped_bytes: int = 0
    mlp_dropped_bytes_sharded: int = 0
    # Of activation_bytes_selective, what selective recomputation drops besides where it repeats the attention's
    # prologue (what that produced, less the inputs it then keeps); 0 without one.
    prologue_dropped_bytes: int = 0
    prologue_dropped_bytes_sharded: int = 0
    # Of activation_bytes, activation_bytes_selective and prologue_dropped_bytes, what modules the tensor-parallel
    # plan leaves whole produced (MLA's latents: replicated, never sequence-split by this executor); 0 without such
    activation_bytes_whole: int = 0
    activation_bytes_selective_whole: int = 0
    prologue_dropped_bytes_whole: int = 0
    # The outputs of the block's weight-carrying ops (a linear's, a norm's scaling), whose gradients a zero-bubble
    # schedule's input backward keeps until the weight backward (torch's pipelining/_backward.py): all of them, the
    # part a tensor-parallel rank holds 1/t of (column-parallel outputs, MoE blocks) and the part it holds whole
    # (row-parallel partial sums); the rest is split over the sequence only under sequence parallelism.
    weight_output_bytes: int = 0
    weight_output_bytes_sharded: int = 0
    weight_output_bytes_whole: int = 0
    # Elements of the block's largest parameter tensor, by how tensor parallelism holds it: split over the tp ranks
    # (PARAM_SHARDED: column- and row-parallel weights, the vocab-parallel embedding), kept whole, and its largest
    # routed-expert tensor (the stacked experts' weight, whole over all experts). torch's AdamW updates a DTensor
    # model one tensor at a time, with two temporaries the size of the tensor it updates (memory.step_bytes).
    largest_split_param: int = 0
    largest_whole_param: int = 0
    largest_expert_param: int = 0
    fwd_ops: OpMix = field(default_factory=OpMix)
    bwd_ops: OpMix = field(default_factory=OpMix)
    tp_views: dict[int, TPView] = field(default_factory=dict)

    def public_dict(self) -> dict[str, Any]:
        """The keys of the ``profile --json`` contract, plus a few more."""
        return {"name": self.name, "kind": self.kind, "params": self.params, "param_bytes": self.param_bytes,
                "fwd_flops": self.fwd_flops, "bwd_flops": self.bwd_flops, "activation_bytes": self.activation_bytes,
                "output_bytes": self.output_bytes, "fwd_ms": self.fwd_ms, "bwd_ms": self.bwd_ms,
                "peak_memory_bytes": self.peak_memory_bytes}


@dataclass
class ModelProfile:
    model: str
    family: str
    spec: dict[str, Any]
    micro_batch: int
    seq_length: int | None
    dtype: str
    device: str
    device_name: str
    num_parameters: int
    vocab_size: int | None
    layers: list[LayerProfile]
    num_active_parameters: int | None = None  # per token, for mixtures of experts (None: = num_parameters)

    @property
    def active_parameters(self) -> int:
        """Parameters one token's forward pass uses (all of them for dense models)."""
        return self.num_parameters if self.num_active_parameters is None else self.num_active_parameters

    @property
    def total_fwd_flops(self) -> int:
        return sum(x.fwd_flops for x in self.layers)

    @property
    def total_bwd_flops(self) -> int:
        return sum(x.bwd_flops for x in self.layers)

    def to_json_dict(self, full: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model, "family": self.family, "micro_batch": self.micro_batch,
            "seq_length": self.seq_length, "dtype": self.dtype, "device": self.device,
            "device_name": self.device_name, "num_parameters": self.num_parameters,
            "num_active_parameters": self.active_parameters, "vocab_size": self.vocab_size,
            "total_fwd_flops": self.total_fwd_flops, "total_bwd_flops": self.total_bwd_flops,
            "layers": [x.public_dict() for x in self.layers],
        }
        tps = sorted({t for x in self.layers for t in x.tp_views})
        if tps:
            out["tensor_parallel"] = {str(t): [dict(name=x.name, **_view_dict(x.tp_views[t])) for x in self.layers]
                                      for t in tps}
        if full:
            out["layers_full"] = [dataclasses.asdict(x) for x in self.layers]
        return out


def _view_dict(v: TPView) -> dict[str, Any]:
    d = dataclasses.asdict(v)
    d.pop("tp")
    return d
