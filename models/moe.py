"""The mixture-of-experts block: router, dropless experts, shared experts, load-balancing loss.

What it computes, per token (Mixtral, arXiv 2401.04088 Sec. 2.1; Qwen3-MoE; DeepSeek-V3, arXiv 2412.19437
Sec. 2.1.2): router scores s = softmax(x W_r) (Mixtral, Qwen3) or sigmoid(x W_r) (DeepSeek-V3), the top-k
experts by score, their scores renormalised to sum to 1 (``moe_norm_topk``) and multiplied by
``moe_routed_scaling_factor``; the output is the weighted sum of those k experts' MLPs plus the shared
experts' MLP. Token-choice and dropless: every expert takes every token routed to it (no capacity).
Group-limited routing (DeepSeek's n_group/topk_group) is :func:`group_limited_topk`. Not modelled: DeepSeek-V3's
auxiliary-loss-free bias updates (an optimiser-side rule; it changes no parameters, FLOPs or traffic).

Expert parallelism hooks (for the executor):

- :func:`local_dispatch` is the one place tokens meet experts: tokens -> per-expert groups -> expert MLPs ->
  weighted combine. Each :class:`MoE` calls it through its ``dispatch`` attribute, so an all-to-all version
  over expert-parallel ranks can be swapped in per module without touching the rest (same signature).
- :class:`GroupedExperts` holds the routed experts as stacked ``(E, in, out)`` tensors: sharding dim 0
  over ep ranks gives each rank whole experts.

Routing modes. Dropless routing is data-dependent: how many tokens an expert gets depends on values. On
the meta device (profiling, planning) and on fake tensors (the dry run) there are no values, so routing is
*balanced*: slot j of token t goes to expert (t·k + j) mod E, so each expert gets T·k/E tokens (the
remainder spread over the first experts), deterministically. The gate still runs and the weights still
come from the real scores, so FLOPs, saved activations and gradients flow as in training. Real devices
route for real unless :func:`balanced_routing` is on.

Load balancing: DeepSeek-V3's sequence-wise auxiliary loss (arXiv 2412.19437 Eqs. 17-20), alpha =
``moe_aux_loss_coeff``, averaged over the sequences of the micro-batch (so its gradient does not depend
on how a batch is split into micro-batches or data-parallel ranks). It is added to the backward pass by
:class:`AuxLossAutoScaler` (Megatron-Core's MoEAuxLossAutoScaler idea): the model's output and the loss
the trainer computes and reports stay the language-model loss. When the executor gives each rank only
part of every sequence (tensor-parallel token shares, context-parallel chunks), :class:`SequenceShards`
says so: the tokens per expert are summed over those ranks and each rank's part of the loss is its
tokens' share, so the parts add up to the single-process loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .specs import TransformerSpec

_BALANCED: ContextVar[bool] = ContextVar("balanced_routing", default=False)
_COLLECTED: ContextVar[list | None] = ContextVar("collected_aux_losses", default=None)


@contextlib.contextmanager
def balanced_routing():
    """Route every token perfectly balanced (see the module docstring) even on a real device."""
    token = _BALANCED.set(True)
    try:
        yield
    finally:
        _BALANCED.reset(token)


def has_no_values(x: torch.Tensor) -> bool:
    """Whether ``x`` is a meta or fake tensor: shapes without values (profiling, the dry run)."""
    if x.device.type == "meta":
        return True
    try:
        from torch._subclasses.fake_tensor import is_fake
    except ImportError:  # pragma: no cover - torch without fake tensors
        return False
    return is_fake(x)


def routes_balanced(x: torch.Tensor) -> bool:
    """Whether tokens ``x`` are routed balanced: asked for, or on meta / fake tensors (no values)."""
    return _BALANCED.get() or has_no_values(x)


@contextlib.contextmanager
def collect_aux_losses():
    """Collect every MoE layer's weighted auxiliary loss of the forward passes run inside (a list of scalar
    tensors with their graphs), e.g. to check the autoscaler against an explicit ``loss + sum(aux)``."""
    found: list[torch.Tensor] = []
    token = _COLLECTED.set(found)
    try:
        yield found
    finally:
        _COLLECTED.reset(token)


class AuxLossAutoScaler(torch.autograd.Function):
    """Forward returns ``output`` unchanged; backward passes its gradient through and gives ``aux_loss`` the
    gradient ``scale``, so autograd adds scale · d(aux_loss)/d(inputs, router weights) to the backward pass
    without the loss ever being added to the model's output.

    ``scale`` is what the trainer multiplies its loss by before backward (1 by default; 1/m when each of m
    micro-batches' losses is divided by m for gradient accumulation; the loss scale under fp16). It is a
    process-wide setting, read when backward runs (autograd may run backward on another thread):
    :func:`set_aux_loss_scale`.
    """

    scale: float = 1.0

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux = (aux_loss.shape, aux_loss.dtype, aux_loss.device)
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        shape, dtype, device = ctx.aux
        return grad_output, torch.full(shape, AuxLossAutoScaler.scale, dtype=dtype, device=device)


def set_aux_loss_scale(scale: float) -> None:
    """Set the factor the auxiliary losses' gradients are multiplied by (see :class:`AuxLossAutoScaler`)."""
    AuxLossAutoScaler.scale = float(scale)


@dataclass(frozen=True)
class SequenceShards:
    """Each rank's MoE layers see only part of every sequence: ``parts`` ranks hold its tokens, ``sum_parts``
    sums a tensor over those ranks (no gradient), and ``grad_factor`` multiplies this rank's part of the
    auxiliary loss before backward (1 where the ranks' gradients are summed, as tensor-parallel ranks' are;
    the number of ranks where they are averaged, as context-parallel ranks' are). Set by the executor."""

    parts: int
    sum_parts: Callable[[torch.Tensor], torch.Tensor]
    grad_factor: float = 1.0


def sequence_aux_loss(scores: torch.Tensor, expert_idx: torch.Tensor, sigmoid: bool,
                      shards: SequenceShards | None = None) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss without alpha (arXiv 2412.19437, Eqs. 17-20), averaged over
    sequences: sum_i f_i·P_i with f_i = E/(k·S) · #tokens routed to expert i, P_i = mean_t s'_{i,t} where
    s' are the scores normalised over experts. 1 when routing is perfectly balanced and uniform.

    With ``shards`` the S tokens here are this rank's part of sequences of ``shards.parts`` times as many:
    f counts the whole sequences' tokens and P sums only this rank's, so the ranks' results add up to the loss.

    scores: (b, S, E) in fp32 or wider; expert_idx: (b, S, k) -> scalar.
    """
    b, s, e = scores.shape
    k = expert_idx.shape[-1]
    probs = scores / scores.sum(-1, keepdim=True) if sigmoid else scores  # (b, S, E), each row sums to 1
    hits = torch.zeros_like(scores).scatter_(2, expert_idx, 1.0).sum(1)  # (b, E) tokens per expert
    if shards is None:
        p = probs.mean(1)  # (b, E)
    else:
        s *= shards.parts  # the whole sequence
        hits = shards.sum_parts(hits)  # (b, E) over the whole sequences
        p = probs.sum(1) / s  # (b, E) this rank's share of the mean
    f = hits * (e / (k * s))  # (b, E)
    return (f * p).sum(-1).mean()


def balanced_assignment(tokens: int, num_experts: int, k: int, device) -> tuple[torch.Tensor, list[int]]:
    """Balanced routing: slot j of token t -> expert (t·k + j) mod E. Returns (expert_idx (T, k), tokens per
    expert), the counts computed without reading any tensor value."""
    idx = (torch.arange(tokens * k, device=device) % num_experts).view(tokens, k)  # (T, k)
    base, extra = divmod(tokens * k, num_experts)
    return idx, [base + (1 if e < extra else 0) for e in range(num_experts)]


def group_limited_topk(scores: torch.Tensor, k: int, groups: int, group_topk: int,
                       group_score: str = "top-sum") -> torch.Tensor:
    """scores (T, E) -> expert_idx (T, k): the k best experts within each token's ``group_topk`` best of ``groups``
    equal blocks of experts, a block scored by the sum of its top k / group_topk scores (``group_score`` "top-sum":
    DeepSeek-V3's node-limited routing, arXiv 2412.19437 Sec. 2.1.2, as Megatron-Core's moe_utils.group_limited_topk)
    or by its best score ("max": DeepSeek-V2's group_limited_greedy, HF modeling_deepseek MoEGate)."""
    t, e = scores.shape
    per_group = scores.view(t, groups, e // groups)  # (T, G, E/G)
    best = k // group_topk if group_score == "top-sum" else 1
    group_scores = per_group.topk(best, dim=-1).values.sum(dim=-1)  # (T, G)
    chosen = group_scores.topk(group_topk, dim=-1).indices  # (T, M)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)  # (T, G)
    masked = per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)  # (T, E)
    return torch.topk(masked, k, dim=-1).indices  # (T, k)


class Router(nn.Module):
    """Top-k token-choice router: an E x h gate (biased with ``bias``: GPT-OSS), softmax or sigmoid scores,
    optionally limited to ``group_topk`` of ``groups`` blocks of experts per token (:func:`group_limited_topk`)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, score_function: str, norm_topk: bool,
                 scaling: float, bias: bool = False, groups: int = 1, group_topk: int = 1,
                 group_score: str = "top-sum"):
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=bias)
        self.num_experts, self.top_k = num_experts, top_k
        self.sigmoid = score_function == "sigmoid"
        self.norm_topk, self.scaling = norm_topk, scaling
        self.groups, self.group_topk, self.group_score = groups, group_topk, group_score

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """x: (T, h) -> scores (T, E) and weights (T, k) in fp32 (or wider), expert_idx (T, k) int64, and the
        tokens per expert (a Python list: the dispatch sizes groups with it)."""
        logits = self.gate(x)  # (T, E), scored in fp32 (or the model's wider dtype)
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        scores = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, dim=-1)
        if routes_balanced(x):
            idx, counts = balanced_assignment(x.shape[0], self.num_experts, self.top_k, x.device)
        elif self.groups > 1:
            idx = group_limited_topk(scores, self.top_k, self.groups, self.group_topk, self.group_score)  # (T, k)
            counts = torch.bincount(idx.flatten(), minlength=self.num_experts).tolist()
        else:
            idx = torch.topk(scores, self.top_k, dim=-1).indices  # (T, k)
            counts = torch.bincount(idx.flatten(), minlength=self.num_experts).tolist()
        weights = scores.gather(1, idx)  # (T, k)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return scores, idx, weights, counts


class GroupedExperts(nn.Module):
    """E expert MLPs as stacked weights: SwiGLU w2(silu(x w1) * x w3) (gated) or GELU w2(gelu(x w1)).

    w1, w3: (E, h, f); w2: (E, f, h); with ``bias`` (GPT-OSS) b1, b3: (E, f), b2: (E, h), zero at start (as
    Megatron-Core initialises biases). ``forward`` takes tokens already grouped by expert.
    """

    BIASES = ("b1", "b2", "b3")  # parameters models.reference_init starts at zero

    def __init__(self, num_experts: int, hidden: int, ffn: int, gated: bool, bias: bool = False):
        super().__init__()
        self.gated = gated
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, ffn))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, ffn)) if gated else None
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)  # the zoo's N(0, 0.02) (models.reference_init draws the same law)
        self.b1 = nn.Parameter(torch.zeros(num_experts, ffn)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(num_experts, hidden)) if bias else None
        self.b3 = nn.Parameter(torch.zeros(num_experts, ffn)) if bias and gated else None

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: (N, h), rows grouped by expert, counts[e] rows for expert e (sum N) -> (N, h).

        Under expert parallelism the weights are DTensors sharded over the experts (dim 0): this rank computes
        with its own experts (``counts`` then has one entry per local expert)."""
        # each stacked weight unbound once into its experts' (in, out) views: in backward their gradients are
        # stacked once (w[e] per expert would write a zero-filled whole-stack gradient per expert and sum them all:
        # traffic growing with the square of the experts)
        w1, w2 = _local(self.w1).unbind(0), _local(self.w2).unbind(0)  # E_local x (h, f), E_local x (f, h)
        w3 = _local(self.w3).unbind(0) if self.gated else None
        b1, b2, b3 = (_local(b).unbind(0) if b is not None else None for b in (self.b1, self.b2, self.b3))
        outs = []
        for e, xe in enumerate(torch.split(x, counts)):  # xe: (n_e, h)
            hidden = xe @ w1[e] if b1 is None else torch.addmm(b1[e], xe, w1[e])  # (n_e, f)
            if self.gated:
                up = xe @ w3[e] if b3 is None else torch.addmm(b3[e], xe, w3[e])  # (n_e, f)
                hidden = F.silu(hidden) * up
            else:
                hidden = F.gelu(hidden, approximate="tanh")
            outs.append(hidden @ w2[e] if b2 is None else torch.addmm(b2[e], hidden, w2[e]))  # (n_e, h)
        return torch.cat(outs)


def _local(w: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (differentiably); a plain tensor as it is."""
    to_local = getattr(w, "to_local", None)
    return to_local() if to_local is not None else w


Dispatch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int], GroupedExperts], torch.Tensor]


def local_dispatch(x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor, counts: list[int],
                   experts: GroupedExperts) -> torch.Tensor:
    """Tokens -> per-expert groups -> expert MLPs -> weighted combine, all experts on this rank.

    x: (T, h); expert_idx, weights: (T, k); counts: tokens per expert (len E, sum T·k) -> (T, h).
    An expert-parallel version keeps this signature: permute the same way, all-to-all the groups (sizes
    from ``counts``) to the ranks owning the experts, run the local experts, all-to-all back, combine.
    """
    k = expert_idx.shape[1]
    order = torch.argsort(expert_idx.reshape(-1), stable=True)  # (T·k,) slots grouped by expert
    token = order // k  # (T·k,) the token each slot belongs to
    out = experts(x[token], counts)  # (T·k, h)
    out = out * weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)  # (T·k, h) weighted
    return torch.zeros_like(x).index_add_(0, token, out)  # (T, h) summed over each token's k slots


class MoE(nn.Module):
    """Router + routed experts (+ shared experts) in place of a layer's MLP: (b, s, h) -> (b, s, h)."""

    def __init__(self, spec: TransformerSpec, shared_experts: nn.Module | None = None):
        super().__init__()
        self.router = Router(spec.hidden_size, spec.num_experts, spec.top_k, spec.moe_score_function,
                             spec.moe_norm_topk, spec.moe_routed_scaling_factor, spec.expert_bias,
                             *spec.routing_limit)
        self.experts = GroupedExperts(spec.num_experts, spec.hidden_size, spec.moe_ffn_size, spec.family == "llama",
                                      spec.expert_bias)
        self.shared_experts = shared_experts
        self.aux_loss_coeff = spec.moe_aux_loss_coeff
        self.dispatch: Dispatch = local_dispatch  # replaceable: expert parallelism swaps in an all-to-all
        self.sequence_shards: SequenceShards | None = None  # set by the executor when sequences are split
        self.last_aux_loss: torch.Tensor | None = None  # detached, for logging

    def inactive_parameters(self) -> int:
        """Routed-expert parameters one token does not use: (E - k) experts' worth."""
        e, k = self.experts.num_experts, self.router.top_k
        return sum(p.numel() for p in self.experts.parameters()) * (e - k) // e

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape  # (b, s, h)
        flat = x.reshape(b * s, h)  # (T, h)
        scores, idx, weights, counts = self.router(flat)
        y = self.dispatch(flat, idx, weights, counts, self.experts)  # (T, h)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat)
        y = y.view(b, s, h)
        if self.aux_loss_coeff > 0 and torch.is_grad_enabled():
            shards = self.sequence_shards
            aux = self.aux_loss_coeff * sequence_aux_loss(scores.view(b, s, -1), idx.view(b, s, -1),
                                                          self.router.sigmoid, shards)
            self.last_aux_loss = aux.detach()
            collected = _COLLECTED.get()
            if collected is not None:
                collected.append(aux)
            y = AuxLossAutoScaler.apply(y, aux * shards.grad_factor if shards is not None else aux)
        return y
