"""Memory per rank: model states (ZeRO's accounting), activations (Korthikanti et al.), an allowance.

Model states (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1 and Fig. 1): mixed-precision Adam keeps
2 bytes of fp16/bf16 weights, 2 of gradients and K = 12 of optimizer state (fp32 master weights,
momentum, variance) per parameter. ZeRO-1 shards the optimizer state over the data-parallel group,
ZeRO-2 also the gradients, ZeRO-3 also the weights. Plain fp32 training keeps 4 + 4 + 8.

Activations per transformer layer and micro-batch (Korthikanti et al. 2022, Table 2): what the
profiler traced the layer to save, split into the part inside the tensor-parallel regions (divided by
t) and the replicated rest (divided by t only with sequence parallelism). Selective recomputation keeps
what is saved without the attention core's internals (and, where the stack reruns the attention's prologue with it,
without what that produced: MLA's up-projection, Megatron-Core's ``mla_up_proj``); MLP recomputation (Megatron-Core's
recompute_modules ``mlp`` and ``moe``) keeps what "none" does less what the MLP sublayer produced and saved (its
input stays, as the checkpoint's); both together ("selective+mlp") what "selective" does less that; full
recomputation keeps only the layer's input (one checkpoint per layer) plus, while a layer's backward runs, that
one layer's activations.
With a fused (flash) attention kernel the score matrix is never saved, so "none" costs what
"selective" does plus the core's output. With Megatron's ``unfused`` attention and dropout (the papers'
setting) each layer also keeps its dropout masks: one byte per element of the two residual-branch
dropouts (2·s·b·h, replicated) and of the attention dropout with its output (3·a·s²·b, sharded) —
exactly the terms by which Korthikanti et al.'s 34·s·b·h + 5·a·s²·b exceeds what our dropout-free
modules save.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from paraplan.hardware_specs import GPUSpec
from paraplan.profiler import LayerProfile

from .layout import recomputes_mlp
from .schedules import RUNTIME_ACTIVE_CHUNKS

GiB = 2**30
# Allowance for the framework: CUDA context, cuBLAS/NCCL workspaces and buffers (~1-2 GiB is what
# PyTorch jobs show on A100/H100 before the model is loaded), or a CPU process's runtime; plus the
# caching allocator's fragmentation, taken as 5% of everything else (PyTorch memory docs report
# 5-10% for training workloads without expandable segments).
FRAMEWORK_GIB = {"gpu": 1.5, "cpu": 0.3}
FRAGMENTATION = 0.05


def state_bytes_per_param(dtype: str, grad_bytes: int = 2, master_bytes: int = 4,
                          moment_bytes: int = 8) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter for Adam in this training dtype; ``grad_bytes``:
    the gradient buffer's bytes per element in 16-bit training (2 in ZeRO's accounting; 4 where the stack
    accumulates and reduces fp32 gradients: Megatron-LM's "bf16 parameters, fp32 gradients: 6 + 12/d" of its
    distributed optimizer, docs/api-guide/dist_optimizer.md). ``master_bytes``, ``moment_bytes``: the optimizer's
    copy of the weights (16-bit training only: fp32 training updates its weights in place) and Adam's two
    moments (framework.OPTIMIZER_STATES; 4 + 8 = ZeRO's K = 12)."""
    return (4, 4, moment_bytes) if dtype == "fp32" else (2, grad_bytes, master_bytes + moment_bytes)


def model_state_bytes(params: float, dtype: str, zero: int, dp: int, optimizer_on_servers: bool = False,
                      grad_bytes: int = 2, master_bytes: int = 4, moment_bytes: int = 8) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes on one rank holding ``params`` parameters (ZeRO Sec. 5)."""
    w, g, o = state_bytes_per_param(dtype, grad_bytes, master_bytes, moment_bytes)
    weights, grads, opt = params * w, params * g, params * o
    if optimizer_on_servers:
        return weights, grads, 0.0
    if zero >= 1:
        opt /= dp
    if zero >= 2:
        grads /= dp
    if zero >= 3:
        weights /= dp
    return weights, grads, opt


def pending_weight_grad_bytes(layer: LayerProfile, b: float, tp: int, sp: bool) -> float:
    """Bytes one rank keeps per micro-batch of ``b`` samples of this block from its input backward to its deferred
    weight backward in a zero-bubble schedule: torch's stage_backward_input keeps the gradient flowing into each
    weight-carrying op's output (pipelining/_backward.py, param_group["grads"]) so that stage_backward_weight can
    form the weights' gradients later, each the size of that output (LayerProfile.weight_output_bytes): 1/t of a
    column-parallel one, the whole of a row-parallel one (its partial sums), and the rest (norms) split over the
    sequence under sequence parallelism."""
    split = layer.weight_output_bytes_sharded
    whole = layer.weight_output_bytes_whole
    rest = layer.weight_output_bytes - split - whole
    return b * (split / tp + whole + rest / (tp if sp else 1))


def layer_activation_bytes(layer: LayerProfile, b: float, tp: int, sp: bool, recompute: str, attention: str,
                           gathered_inputs: bool = False, prologue: bool = True,
                           softmax_fallback: bool = False, whole_latents: bool = False) -> float:
    """Bytes one rank keeps for one micro-batch of ``b`` samples through this block until its backward.

    ``gathered_inputs``: under sequence parallelism the column-parallel linears keep the input they were
    given — with DTensor's PrepareModuleInput (this executor) the all-gathered, whole-sequence tensor, not
    the rank's shard (Megatron keeps the shard and gathers it again in backward). ``prologue``: selective
    recomputation reruns the attention's prologue (models.in_attention_prologue; not under this executor's
    context parallelism, whose K/V gather comes between it and the core). ``softmax_fallback``: the unfused
    attention's softmax runs PyTorch's fp32 path (compute.softmax_falls_back), whose softmax keeps its fp32 output
    (2 bytes per 16-bit score more than the fused kernel's 16-bit one). ``whole_latents``: under sequence
    parallelism what the modules the tensor-parallel plan leaves whole produced (MLA's latents:
    LayerProfile.activation_bytes_whole) stays whole, as where those modules run on the gathered sequence (this
    executor, torchtitan); Megatron-Core runs them on each rank's shard (costmodel._replicated_on_shard)."""
    if recompute == "full":
        return layer.input_bytes * b / (tp if sp else 1)
    extra = 0.0
    if sp and gathered_inputs and tp > 1:
        gathered = [ib for style, ib, _, _ in layer.region_io if style in ("region", "vocab_head")]
        if recomputes_mlp(recompute) and not layer.moe_params and len(gathered) >= 2:
            gathered = gathered[:-1]  # the MLP region gathers its input inside the recomputed sublayer
        extra = sum(gathered) * b * (1 - 1 / tp)
    if recomputes_mlp(recompute):  # what "none" (or "selective") keeps, less what the MLP sublayer produced and saved
        rest = "selective" if recompute == "selective+mlp" else "none"  # the attention's part: disjoint from the MLP's
        kept = layer_activation_bytes(layer, b, tp, sp, rest, attention, prologue=prologue,
                                      softmax_fallback=softmax_fallback, whole_latents=whole_latents)
        dropped, dropped_sharded = layer.mlp_dropped_bytes, layer.mlp_dropped_bytes_sharded
        return kept - b * (dropped_sharded / tp + (dropped - dropped_sharded) / (tp if sp else 1)) + extra
    if recompute == "selective" or attention == "flash":
        total, sharded = layer.activation_bytes_selective, layer.activation_bytes_selective_sharded
        whole = layer.activation_bytes_selective_whole
        # Without recomputation a fused kernel keeps its output for its backward, but that is the tensor the output
        # projection keeps as its input, which the selective count holds already: the flash kernel writes (b, s, a, d)
        # and returns it transposed, so the layer's transpose-and-reshape is a view, not a copy (on the CPU, a test;
        # traced on the CUDA device in the dry run, llama2-70b tp2 sp: one s·h/t tensor per layer where two were
        # priced, 4% of a layer's activations). Its log-sum-exp (b·a·s fp32, under 0.1% of a layer's) is left out.
        if recompute != "none" and prologue:
            # selective reruns the attention's prologue too (MLA's up-projection): what it made goes
            total -= layer.prologue_dropped_bytes
            sharded -= layer.prologue_dropped_bytes_sharded
            whole -= layer.prologue_dropped_bytes_whole
    else:
        total, sharded, whole = layer.activation_bytes, layer.activation_bytes_sharded, layer.activation_bytes_whole
    if attention == "unfused" and layer.kind == "transformer_layer":
        hidden_masks = layer.input_bytes / _elem(layer) * 2  # 2 masks x s·b·h elements x 1 byte
        replicated_extra = hidden_masks
        # the softmax's output (16-bit, or fp32 on PyTorch's path) and the dropout's one-byte mask
        sharded_extra = 0.0 if recompute == "selective" else \
            (2.5 if softmax_fallback else 1.5) * layer.fwd_ops.core_scores_bytes
        total, sharded = total + replicated_extra + sharded_extra, sharded + sharded_extra
    replicated = total - sharded
    whole = whole if sp and whole_latents else 0.0  # of replicated: kept whole under SP
    return b * (sharded / tp + ((replicated - whole) / tp + whole if sp else replicated)) + extra


def _elem(layer: LayerProfile) -> int:
    """Bytes per element of the block's activations (its input is s·b·h of them)."""
    return max(1, round(layer.param_bytes / layer.params)) if layer.params else 2


def framework_allowance(gpu: GPUSpec) -> float:
    return FRAMEWORK_GIB["cpu" if gpu.is_cpu else "gpu"] * GiB


@dataclass(frozen=True)
class StateBytes:
    """Bytes a rank keeps per parameter it holds, by kind, at its memory peak; ``unit_weights``: bytes per
    parameter of its largest transformer-layer FSDP unit, twice (gathered copies live at once under ZeRO 3:
    the unit that runs and the one prefetched); ``root_weights``: per parameter of the chunk's root unit
    (embedding, head), which FSDP2 gathers for the whole of each forward and each backward (under ZeRO 3 resharded
    between them, as this executor asks: without a pipeline the loss's backward holds none,
    costmodel._loss_moments)."""

    weights: float
    grads: float
    optimizer: float
    unit_weights: float = 0.0
    unit_grads: float = 0.0  # per parameter of the staged unit, per chunk on the rank: its gradient being reduced
    # per parameter of the largest layer unit: the gradients its backward writes to the unsharded weights (the compute
    # copy's dtype) before the unit's reduce copies them into its buffer (unit_grads)
    unit_wgrads: float = 0.0
    root_weights: float = 0.0  # per parameter of the root unit (embedding, head): gathered through each pass (ZeRO 3)
    staging_held: bool = False  # each pipeline chunk keeps its last reduce buffer (staged_unit_params)
    # ZB-V under ZeRO 2/3 in mixed precision: per parameter of a stage, the 16-bit gradients its weight backward (W)
    # writes, which FSDP2 folds into the fp32 sums at the stage's next input backward (post-backward's
    # accumulate_unsharded_grad_if_needed); held where the stage's last backward task was a W (schedules.unfolded_key)
    unfolded: float = 0.0
    # per parameter, besides ``weights``, what the step's first moment holds: torch's multi-stage runtime gathers its
    # first chunks at once before any activation exists (ZeRO 3, interleaved: _state_bytes); gradients are None then
    start_weights: float = 0.0
    # per parameter of a chunk whose whole-chunk gathers are pending (ZeRO 3, interleaved with more chunks a rank than
    # the runtime keeps active: schedules.gathered_key's moments), outside its root unit (root_weights)
    chunk_gather: float = 0.0
    # The optimizer step's moment (step_bytes): per parameter, the weights and gradients then (the master weights
    # and the reduced gradients: FSDP2 frees its gathered copies and reduce buffers after the last backward), and
    # what Adam's step allocates beside the states: ``step_largest`` bytes per element of the rank's largest
    # parameter tensor (tensor-parallel shard, before ZeRO's; one tensor at a time), or ``step_all`` bytes per
    # parameter (foreach); 0 where the step allocates nothing (Framework.adam_step)
    step_weights: float = 0.0
    step_grads: float = 0.0
    step_largest: float = 0.0
    step_all: float = 0.0

    @property
    def step_allocates(self) -> bool:
        """Does Adam's step allocate beside the states (its moment may then be the peak: step_bytes)?"""
        return bool(self.step_largest or self.step_all)

    @property
    def per_param(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def start_per_param(self) -> float:
        """Bytes per parameter at the step's first moment (start_bytes): weights with their start gathers, optimizer."""
        return self.weights + self.start_weights + self.optimizer


def state_bytes(framework, lay, data_ranks: int | None = None) -> StateBytes:
    """Model-state bytes per parameter for ``lay`` under ``framework`` (planner/framework.py).

    ``executor`` (FSDP2 mixed precision, executor/data_parallel.py): fp32 master weights (4 B, sharded over
    dp by ZeRO 2/3), a 16-bit copy for compute (2 B: replicated ZeRO 0/1 cast it, ZeRO 2 gathers it once and
    keeps it until the step's last backward, ZeRO 3 gathers a unit at a time), fp32 gradients (4 B; sharded
    by ZeRO 2/3, whose reduce-scatter runs every micro-batch — except under ZB-V, which accumulates them
    unsharded), Adam's two fp32 moments (8 B, sharded by ZeRO 1-3). In fp32 there is no 16-bit copy, but FSDP2's
    replicate (ZeRO 0/1 over dp > 1 with pipeline, tensor or expert parallelism) gathers an fp32 one;
    DistributedDataParallel (the rest) holds gradient buckets instead (:func:`ddp_buckets`).
    ``zero``: ZeRO's accounting (:func:`model_state_bytes`). ``data_ranks``: the ranks ZeRO shards over, when
    not the layout's dp x cp (the experts' edp: moe.expert_states). The step's temporaries (StateBytes.step_largest,
    step_all) follow the rank's one optimizer: ZeRO-1's over either group updates views (executor/parallelize.py).
    """
    # ZeRO shards over the data-parallel and context-parallel ranks; the search asks for thousands of layouts
    # that share these few fields
    # FSDP2's replicate wraps the weights (executor/data_parallel.py shard_dp): the layer's where dp > 1 and
    # DistributedDataParallel is not used (pipeline, tensor or expert parallelism); expert-parallel experts' where
    # either the layer's or their own edp has replicas
    if data_ranks is None:
        replicated = lay.data_ranks > 1 and not _data_parallel_alone(lay)
    else:
        replicated = lay.ep > 1 and (lay.data_ranks > 1 or data_ranks > 1)
    return _state_bytes(framework, lay.data_ranks if data_ranks is None else data_ranks, lay.zero, lay.dp_mode,
                        lay.dtype, lay.pp, lay.schedule, replicated, lay.virtual_stages, lay.tp > 1 or lay.ep > 1,
                        lay.zero == 1 and lay.dp_mode != "ps" and (lay.data_ranks > 1 or (data_ranks or 1) > 1))


def ddp_buckets(framework, lay) -> bool:
    """Does this executor wrap ``lay`` in DistributedDataParallel (executor/data_parallel.py uses_ddp: fp32, ZeRO 0/1
    over dp > 1, no tensor, pipeline or expert parallelism)? Its gradient buckets are allocated with the wrapper,
    so the gradients are in memory from the first forward on (CostModel.grads_at_activation_peak)."""
    return framework.states == "executor" and lay.dtype == "fp32" and lay.zero <= 1 and lay.data_ranks > 1 \
        and lay.dp_mode != "ps" and _data_parallel_alone(lay) and lay.head_parallel == 1


def _data_parallel_alone(lay) -> bool:
    """No pipeline, tensor or expert parallelism beside the data parallelism: where this executor's fp32 ZeRO 0/1
    takes DistributedDataParallel rather than FSDP2's replicate (executor/data_parallel.py uses_ddp)."""
    return lay.pp == 1 and lay.tp == 1 and lay.ep == 1


@lru_cache(maxsize=4096)
def _state_bytes(framework, dp: int, zero: int, dp_mode: str, dtype: str, pp: int, schedule: str,
                 replicated: bool = False, virtual_stages: int = 1, dtensors: bool = False,
                 views: bool = False) -> StateBytes:
    if dp_mode == "ps":
        zero = 0
    fp8 = framework.fp8_weight_bytes if dtype == "fp8" else 0.0  # FP8 weight copies (planner/fp8.py)
    if framework.states != "executor":
        w, g, o = model_state_bytes(1.0, dtype, zero, dp, optimizer_on_servers=dp_mode == "ps",
                                    grad_bytes=framework.grad_bytes, master_bytes=framework.master_bytes,
                                    moment_bytes=framework.moment_bytes)
        elem = 4 if dtype == "fp32" else 2
        return StateBytes(w + fp8, g, o, unit_weights=2 * elem if zero == 3 and dp > 1 else 0.0)
    mixed = dtype != "fp32"
    sharded = zero >= 2 and dp > 1
    # the weights FSDP2 shards: fp32 (this executor, torchtitan), or the 16-bit weights themselves where the stack
    # builds its model in bf16 (Framework.master_bytes 2: NeMo Automodel), Adam's moments then bf16 too
    master = framework.master_bytes if mixed else 4
    weights = master / dp if sharded else float(master)
    copy = 2.0 if mixed else 4.0  # what FSDP2 gathers for compute
    unit = root = start = chunk = 0.0
    if zero == 3 and dp > 1:
        unit, root = 2 * copy, copy
        if pp > 1 and schedule == "interleaved-1f1b":
            # torch's multi-stage runtime unshards whole chunks itself (_PipelineScheduleRuntime's UNSHARD actions,
            # torch/distributed/pipelining/schedules.py _add_unshard_reshard): before each action it issues the
            # all-gathers of every unit of the next three distinct chunks the rank computes that are not yet
            # active, and each all-gather's output stays until that chunk's next compute waits on it (FSDP2's
            # unshard(async_op=True)); the compute's own hooks then gather and free one unit at a time as before.
            # With v <= 3 chunks a rank never evicts one: all its chunks are gathered at the step's first action,
            # before any activation or gradient exists, and not again (start_weights). With v > 3 chunks keep
            # entering the window: the first action gathers three (start_weights, for chunks of about equal size:
            # the chunk rule), and each later moment holds the chunks schedules.runtime_gathers has pending then
            # (chunk_gather per parameter of each, priced per moment with its activations: peak_holdings' gathers).
            # Traced (executor/trace.py: the live tensors at the peak), llama2-70b dp16 tp2 pp2 full recomputation:
            # v = 2, the 40 layers' all-gather outputs of the rank (34.2 GB) at the first action; v = 4, rank 0's
            # peak in the cool-down, three chunks gathered (one copied out, 20 layers' outputs pending) beside six
            # chunk micro-batches of its most nine. (Priced before as ZeRO-2's copy kept all step: 9-30 GiB over;
            # then as the chunks pending near the most micro-batches: v = 4's rank 0 5.6% under.)
            if virtual_stages <= RUNTIME_ACTIVE_CHUNKS:
                start = copy
            else:
                start, chunk = copy * RUNTIME_ACTIVE_CHUNKS / virtual_stages, copy
    elif sharded or (mixed and master > 2):
        weights += copy
    elif replicated and dp_mode != "ps":
        # fp32 under FSDP2's replicate (state_bytes says where): it all-gathers the unsharded weights into buffers
        # of their own, a second fp32 copy for the step's compute (the dry run traced twice the weights on such
        # plans: llama-tiny dp2 tp2, mixtral-tiny dp2 ep2 — its experts too, replicated over a one-rank edp)
        weights += copy
    grads = 4 / dp if sharded else 4.0
    unfolded = 0.0
    unsharded_sums = sharded and sums_unsharded(framework, pp, schedule)
    if unsharded_sums:
        # ZB-V, or a stack that syncs gradients on the last backward only (dp_sync.reduces_once), accumulates
        # unsharded: fp32 sums (4 B) plus, in mixed precision, the 16-bit gradients of the passes not yet folded
        # into them (2 B; FSDP2's to_accumulated_grad_if_needed); the fp32 shards appear only after the step. Under
        # ZB-V those 16-bit gradients exist only from a stage's W to its next B (StateBytes.unfolded): where the V
        # turns, the cool-down's input backwards fold them all (llama2-70b dp2 tp4 pp8: 4.0 B a parameter traced on
        # the last three ranks at their peaks, 4.8-5.3 on the others; priced 6 everywhere before, every rank's
        # tensors within 0.8% of the trace since)
        grads = 4.0 + (2.0 if mixed else 0.0)
        if mixed and pp > 1 and schedule == "zb-v":
            grads, unfolded = 4.0, 2.0
    moments = framework.moment_bytes if mixed else 8
    optimizer = 0.0 if dp_mode == "ps" else (moments / dp if zero >= 1 else float(moments))
    # FSDP2 reduces a unit's gradient through a flat fp32 buffer of the whole unit (traced: 4 B per parameter
    # of the unit); it meets the activation peak where units reduce during a backward — every micro-batch
    # (ZeRO 2/3 outside ZB-V) or the last one without a pipeline — not after a pipeline's last backward.
    # Each FSDP root (one per pipeline chunk) keeps its last reduce-scatter's buffer until its next backward where the
    # backward is not the step's last (FSDPCommContext.reduce_scatter_states, cleared by the root's final callback on
    # the last backward only): the pipeline stages mark the others so (executor/pipeline.ShardedGradStage), the
    # trainer without a pipeline does not. rank_memory then counts one per chunk (staged_unit_params).
    # DDP's buckets are views of the gradients.
    during_backward = (sharded and not unsharded_sums) or pp == 1
    staging = 4.0 if dp > 1 and (mixed or zero >= 2) and during_backward else 0.0
    # Where a unit reduces in the backward, autograd first writes its weights' gradients to the unsharded weights, in
    # their dtype, and the unit's post-backward copies them into the buffer it reduces: inside a layer's backward its
    # MLP's are there while the activations it freed were fewer. Traced (executor/trace.py, the live tensors at the
    # peak), llama2-70b dp8 tp2 pp4 1F1B ZeRO-3 (the demo's plan): the three MLP weights' bf16 gradients (3 x 235 MB)
    # at every rank's peak, beside the earlier unit's fp32 buffer and the prefetched unit; priced as the whole unit's.
    # Not where torch's runtime gathers whole chunks (interleaved ZeRO-3): those peaks come at a backward's start, the
    # gathers' moments (tests/test_costmodel.py test_gather_moments_find_the_traced_peaks: none traced there). Mixed
    # precision only: in fp32 (llama-tiny dp2 pp2 1F1B ZeRO-3, traced) the peaks held none. ZeRO 0-2 and a model
    # without a pipeline take the same FSDP2 path (a unit's gradients written, then copied into its reduce buffer),
    # not traced at scale.
    wgrads = copy if staging and mixed and not (start or chunk) else 0.0
    # The optimizer step (step_bytes): the master weights and the reduced gradients (in the master's dtype, FSDP2's
    # cast of its reduction to the sharded parameter's: the fp32 shards under ZeRO 2/3) beside the moments, and Adam's
    # temporaries (Framework.adam_step). ZeRO-1's optimizer updates plain views of the rank's share
    # (executor/optim.py ShardedOptimizer), as do DDP and a single fp32 rank without tensor or expert parallelism (no
    # FSDP2 wrapper: executor/data_parallel.py shard_dp); every other layout's parameters are DTensors. Traced
    # (executor/trace.py, the live tensors at the peak), gpt-small tp2 pp2 full recomputation in bf16, rank 0: two
    # fp32 temporaries the size of its vocab-sharded embedding (98 MiB each) beside the fp32 weights, gradients and
    # moments, no activation: the rank's peak (priced 5.1% under it without this moment).
    plain = views or not (mixed or sharded or replicated or dtensors)
    step = framework.adam_step
    if step == "executor":
        step = "foreach" if plain else "for-loop"
    step_largest = optimizer if step == "for-loop" else 0.0  # two temporaries in the moments' dtype, sharded alike
    step_all = optimizer / 2 if step == "foreach" else 0.0  # one copy of each second moment
    return StateBytes(weights + fp8, grads, optimizer, unit_weights=unit, unit_grads=staging, unit_wgrads=wgrads,
                      root_weights=root,
                      staging_held=bool(staging) and sharded and not unsharded_sums and pp > 1, unfolded=unfolded,
                      start_weights=start, chunk_gather=chunk, step_weights=master / dp if sharded else float(master),
                      step_grads=master / dp if sharded else float(master), step_largest=step_largest,
                      step_all=step_all)


def sums_unsharded(framework, pp: int, schedule: str) -> bool:
    """Does an FSDP2 stack ("executor" states) under ZeRO 2/3 sum its gradients unsharded through the step and
    reduce-scatter them once (ZB-V's pipeline; a stack that turns gradient sync off until the last backward:
    Framework.zero23_every_micro_batch False), rather than every micro-batch?"""
    return (pp > 1 and schedule == "zb-v") or not framework.zero23_every_micro_batch


def rank_memory(states: StateBytes, params: float, unit_params: float, activations: float, gpu: GPUSpec,
                grads_arrive_after: float | None = None, *, staged_params: float, experts: float = 0.0,
                expert_states: StateBytes | None = None, root_params: float = 0.0,
                unfolded_grads: float = 0.0, start_moment: bool = True, gathered_weights: float = 0.0,
                staged_bytes: float = 0.0, largest_param: float = 0.0, largest_expert: float = 0.0
                ) -> dict[str, float]:
    """Bytes by kind on a rank holding ``params`` parameters (largest layer unit ``unit_params``, root unit
    ``root_params``) and keeping
    ``activations`` at its peak: weights (gathered units included), gradients, optimizer, activations, and
    what no tensor shows — the framework allowance and the allocator's fragmentation (``other``). Where the step's
    first moment holds more (StateBytes.start_weights: chunks gathered before any activation), or the optimizer step
    (:func:`step_bytes`, ``largest_param`` and ``largest_expert`` its largest tensors' elements), that moment's
    bytes instead, unless ``start_moment`` is False (the activation peak's alone: :func:`start_bytes` and
    :func:`step_bytes` are the others).

    ``staged_params``: the parameters whose gradients sit in reduce-scatter buffers at the peak (states.unit_grads
    bytes each): :func:`staged_unit_params`; ``staged_bytes``: reduce buffers' bytes given as such instead (ZeRO-3
    interleaved with whole-chunk gathers: each moment's own, costmodel.reduce_buffer_bytes).

    ``grads_arrive_after``: when the activation peak comes before the rank's first backward has produced
    gradients (one micro-batch, or the pipeline's warm-up peak), the bytes of activations that first backward
    frees as the gradients appear: the gradients then add only what exceeds them (None: gradients are
    there at the activation peak — accumulated from earlier micro-batches).

    ``experts``: expert-parallel parameters held besides ``params``, with their own ``expert_states`` (ZeRO
    shards them over the expert-data-parallel group: planner/moe.py). ``unfolded_grads``: bytes of 16-bit gradients not
    yet folded into their sums at the peak (StateBytes.unfolded: ZB-V's stages whose last backward task was a W).
    ``gathered_weights``: bytes of whole chunks whose gathers are pending at the peak (StateBytes.chunk_gather)."""
    es = expert_states or states
    grads = params * states.grads + experts * es.grads
    if grads_arrive_after is not None:
        grads = max(0.0, grads - grads_arrive_after)
    out = {"params": params * states.weights + experts * es.weights + unit_params * states.unit_weights
           + root_params * states.root_weights + gathered_weights,
           "grads": grads + staged_params * states.unit_grads + staged_bytes + unfolded_grads
           + unit_params * states.unit_wgrads,
           "optimizer": params * states.optimizer + experts * es.optimizer,
           "activations": activations}
    if start_moment and (states.start_weights or es.start_weights):
        first = start_bytes(states, params, experts, es)
        if sum(first.values()) > sum(out.values()):
            out = first
    if start_moment and (states.step_allocates or es.step_allocates):
        last = step_bytes(states, params, largest_param, experts, largest_expert, es)
        if sum(last.values()) > sum(out.values()):
            out = last
    out["other"] = untracked_bytes(gpu, sum(out.values()))
    return out


def step_bytes(states: StateBytes, params: float, largest_param: float, experts: float = 0.0,
               largest_expert: float = 0.0, expert_states: StateBytes | None = None) -> dict[str, float]:
    """Tensor bytes by kind at the optimizer step's peak on a rank holding ``params`` parameters (its largest tensor
    ``largest_param`` elements, tensor-parallel shard) and ``experts`` expert-parallel ones (largest
    ``largest_expert``): the master weights, the reduced gradients, the optimizer's states and what Adam allocates
    as it updates (StateBytes.step_largest, step_all: under "optimizer"); no activation, no gathered copy."""
    es = expert_states or states
    temporaries = max(largest_param * states.step_largest, largest_expert * es.step_largest) \
        + params * states.step_all + experts * es.step_all
    return {"params": params * states.step_weights + experts * es.step_weights,
            "grads": params * states.step_grads + experts * es.step_grads,
            "optimizer": params * states.optimizer + experts * es.optimizer + temporaries, "activations": 0.0}


def start_bytes(states: StateBytes, params: float, experts: float = 0.0,
                expert_states: StateBytes | None = None) -> dict[str, float]:
    """Tensor bytes by kind at the step's first moment where torch's runtime gathers whole chunks then
    (StateBytes.start_weights): weights with those gathers and optimizer states; no gradient (the last step's
    were set to None) and no activation yet."""
    es = expert_states or states
    return {"params": params * (states.weights + states.start_weights) + experts * (es.weights + es.start_weights),
            "grads": 0.0, "optimizer": params * states.optimizer + experts * es.optimizer, "activations": 0.0}


def staged_unit_params(states: StateBytes, largest_layer_unit: float, root_units: list[float]) -> float:
    """Parameters whose fp32 gradients FSDP2 holds in reduce buffers at a rank's peak (states.unit_grads bytes each).

    Where pipelined units reduce every micro-batch (ZeRO 2/3 outside ZB-V: ``states.staging_held``), each pipeline
    chunk on the rank keeps the buffer of the last unit it reduced — its root unit (embedding, norm and head: the
    last to reduce) or its first layer — until its next backward, and the chunk in its backward holds the one it is
    reducing, up to its largest unit: priced per chunk (``root_units``: each chunk's root unit) as the larger of its
    root unit and the rank's largest layer unit (``largest_layer_unit``, BlockCost.reduce_unit). Otherwise (no
    pipeline, or one reduce after the last backward) the unit being reduced: the largest layer unit.

    Traced (executor/trace.py), llama2-70b dp2 tp2 pp8 cp2 interleaved x4 ZeRO-2: four (427,835,392,) fp32 buffers
    on every rank (6.4 GiB; one was priced); llama-small tp2 pp2 ZeRO-2: under 1F1B the embedding's 65.5 MB buffer
    on the first stage and the head's on the last, where a 23.6 MB layer unit was priced; interleaved x2, the head's
    and a layer's on the last rank."""
    if not states.staging_held:
        return largest_layer_unit
    return sum(max(largest_layer_unit, root) for root in root_units)


def untracked_bytes(gpu: GPUSpec, tensor_bytes: float) -> float:
    """What a process holds beyond its tensors: the framework allowance (CUDA context, workspaces) and the
    caching allocator's fragmentation on top of ``tensor_bytes``."""
    return framework_allowance(gpu) + FRAGMENTATION * tensor_bytes


def loss_bytes(tokens: float, vocab: int, tp: int, framework, pipelined: bool) -> tuple[float, float]:
    """(kept, working): what the cross-entropy of one micro-batch of ``tokens`` tokens holds beyond the
    log-probabilities the profile saves, traced in the executor's dry run (executor/trace.py):

    - working, live while its backward runs: without tensor parallelism (``F.cross_entropy`` on fp32
      logits) nll_loss's and log_softmax's gradients, fp32 each: 8·T·V bytes; with it (torch's
      ``loss_parallel`` on vocabulary shards) the gradient buffer, the exponentials and their sum: 12·T·V/t;
    - kept until its backward, per micro-batch in flight: on a pipeline's last stage the schedule holds the
      stage's output, the 16-bit logits: 2·T·V/t.
    Megatron's fused vocab-parallel cross-entropy computes its gradient in the buffer it saved: nothing more.

    A cross-entropy on the 16-bit logits themselves (Framework.loss_logits "16-bit": NeMo Automodel's
    MaskedCrossEntropy with fp32_upcast false, F.cross_entropy on the logits made whole on every rank by
    DTensor.full_tensor where they are vocabulary-sharded), its model output referenced through the backward:
    - kept: the 16-bit logits the output holds (2·T·V/t) and the 16-bit log-probabilities log_softmax saves,
      whole (2·T·V), less the fp32 shard the profile's own loss saved (4·T·V/t): 2·T·V·(1 - 1/t), none at t = 1;
    - working: nll_loss's and log_softmax's 16-bit gradients, whole: 4·T·V.
    """
    if framework.states != "executor":
        return 0.0, 0.0
    shard = tokens * vocab / tp
    if framework.loss_logits == "16-bit":
        return 2 * tokens * vocab - 2 * shard, 4 * tokens * vocab
    return (2 * shard if pipelined else 0.0), (8 * shard if tp == 1 else 12 * shard)

