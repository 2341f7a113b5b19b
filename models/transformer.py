"""GPT, LLaMA and BERT as torch modules made of pipeline-splittable blocks.

Blocks (FQNs): ``embed``, ``layers.0`` ... ``layers.{L-1}``, ``head``. Q, K and V are separate
linears (not one fused QKV) so that column-parallel sharding splits whole heads. Attention reads the
head count from the tensor it gets (``view(b, s, -1, head_dim)``), so the same code runs with the
local heads of a tensor-parallel rank. There is no dropout: training runs stay deterministic and
independent of the layout (modern LLM pre-training uses none either).

Variants the spec switches on: Qwen3's per-head RMSNorm on queries and keys (``qk_norm``), DeepSeek's
multi-head latent attention (:class:`LatentAttention`), and mixture-of-experts layers, whose MLP is an
:class:`~.moe.MoE` held as ``layers.N.moe`` (dense layers keep ``layers.N.mlp``).

Context parallelism (the executor's, executor/context_parallel.py) hands the embedding and the attention
modules a :class:`SequenceShard`: the model then sees only some positions of each sequence, takes their
global positions for learned and rotary embeddings, and attends with keys and values gathered from the
whole sequence under the shard's causal mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextvars import ContextVar
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .moe import MoE
from .norms import RMSNorm
from .specs import TransformerSpec
from .staged import StagedModel

_UNFUSED_ATTENTION: ContextVar[bool] = ContextVar("unfused_attention", default=False)
_IN_ATTENTION_CORE: ContextVar[bool] = ContextVar("in_attention_core", default=False)
_IN_ATTENTION_PROLOGUE: ContextVar[bool] = ContextVar("in_attention_prologue", default=False)


def in_attention_core() -> bool:
    """True while softmax(QK^T)V runs: the part selective recomputation recomputes (the profiler asks)."""
    return _IN_ATTENTION_CORE.get()


def in_attention_prologue() -> bool:
    """True while the attention core's queries, keys and values are formed from what the layer keeps anyway and
    selective recomputation reruns with the core: multi-head latent attention's latent norms and up-projection
    (Megatron-Core's recompute_modules ``mla_up_proj``); with Qwen3's query/key norms, those norms and the rotary
    embedding (one checkpoint from the projections on). Not under context parallelism,
    whose K/V gather sits between them and the core. The profiler asks."""
    return _IN_ATTENTION_PROLOGUE.get()


@contextlib.contextmanager
def _attention_prologue(active: bool = True):
    token = _IN_ATTENTION_PROLOGUE.set(active)
    try:
        yield
    finally:
        _IN_ATTENTION_PROLOGUE.reset(token)


def _recomputed(fn: Callable[..., torch.Tensor], recompute: bool, *args) -> torch.Tensor:
    """``fn(*args)``; with ``recompute`` (selective recomputation: the executor sets the attention's
    ``recompute_core``) under a checkpoint that keeps only ``args`` and runs ``fn`` again in backward."""
    if recompute and torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)


@contextlib.contextmanager
def unfused_attention():
    """Run attention as explicit matmul-softmax-matmul in the model's dtype (what Megatron's unfused
    kernels do and Korthikanti et al. 2022 analyse), instead of torch's fused SDPA. The profiler
    traces under this on the meta device, where SDPA would take a CPU math path that upcasts to fp32."""
    token = _UNFUSED_ATTENTION.set(True)
    try:
        yield
    finally:
        _UNFUSED_ATTENTION.reset(token)


class SequenceShard(Protocol):
    """This rank's positions of every sequence under context parallelism (set on modules by the executor)."""

    def positions(self, device: torch.device) -> torch.Tensor:
        """(s_local,) int64: the global position of each local token."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(b, a, s_local, d) keys or values -> (b, a, s, d) of every rank's positions, differentiably."""
        ...

    def causal_mask(self, device: torch.device) -> torch.Tensor:
        """(s_local, s) bool: whether each local query may attend each gathered key (keys up to its position)."""
        ...


def _attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v.  q: (b, a, s_q, d), k, v: (b, kv, s_k, d) -> (b, a, s_q, d), kv dividing a: with
    grouped-query attention each K/V head serves a/kv query heads. ``mask`` (s_q, s_k) bool, True where a query
    attends a key, replaces the causal triangle (context parallelism)."""
    token = _IN_ATTENTION_CORE.set(True)
    try:
        return _attention_math(q, k, v, causal, mask)
    finally:
        _IN_ATTENTION_CORE.reset(token)


def _attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    mask: torch.Tensor | None) -> torch.Tensor:
    grouped = k.shape[1] != q.shape[1]
    if not _UNFUSED_ATTENTION.get():
        # The fused kernel shares each K/V head among its query heads itself (enable_gqa), so what it keeps for its
        # backward is K and V as projected (flash attention, on a GPU as on the CPU), as Transformer Engine's and
        # torchtitan's attention keep; repeated first, K and V were kept a/kv times over.
        if mask is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=grouped)
    if grouped:  # an unfused kernel multiplies every query head by its own copy (Megatron's unfused path expands them)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (b, a, s_k, d)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = q.shape[2]
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)  # (b, a, s_q, s_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif causal:  # an additive mask: autograd keeps nothing for it (Megatron's fused scale-mask-softmax)
        scores = scores + torch.full((s, s), float("-inf"), dtype=scores.dtype, device=q.device).triu(1)
    return torch.softmax(scores, dim=-1) @ v


def _rotate(x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021), halves layout as in HF LLaMA.  x: (b, a, s, d);
    ``positions`` (s,): each token's position in its sequence (default 0 .. s-1)."""
    b, a, s, d = x.shape
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))  # (d/2,)
    pos = torch.arange(s, device=x.device) if positions is None else positions
    angles = torch.outer(pos.to(torch.float32), inv_freq)  # (s, d/2)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).to(x.dtype)  # (s, d)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    """Multi-head (or grouped-query) self-attention with separate Q/K/V projections; with ``qk_norm`` an
    RMSNorm over each head's query and key before the rotary embedding (Qwen3)."""

    def __init__(self, spec: TransformerSpec):
        super().__init__()
        bias = spec.family != "llama"
        h, d = spec.hidden_size, spec.head_dim
        self.head_dim = d
        self.causal = spec.family != "bert"
        self.rotary = spec.family == "llama"
        qkv_bias = bias or spec.qkv_bias  # Qwen2's llama layer: biased q, k and v, not o
        self.wq = nn.Linear(h, spec.num_attention_heads * d, bias=qkv_bias)
        self.wk = nn.Linear(h, spec.kv_heads * d, bias=qkv_bias)
        self.wv = nn.Linear(h, spec.kv_heads * d, bias=qkv_bias)
        self.wo = nn.Linear(spec.num_attention_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, eps=1e-6) if spec.qk_norm else None
        self.k_norm = RMSNorm(d, eps=1e-6) if spec.qk_norm else None
        self.sequence_shard: SequenceShard | None = None  # context parallelism (the executor sets it)
        self.recompute_core = False  # selective recomputation (the executor sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (b, s, h)
        q = self.wq(x).view(b, s, -1, self.head_dim)  # (b, s, a_local, d)
        k = self.wk(x).view(b, s, -1, self.head_dim)  # (b, s, kv_local, d)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        y = _recomputed(self._prologue_and_core, self.recompute_core and self._whole(), q, k, v)  # (b, a_local, s, d)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))  # (b, s, h)

    def _whole(self) -> bool:
        """Is the prologue recomputed with the core? With query/key norms it is (norms, rotary embedding: one
        checkpoint from the projections on), but not around context parallelism's K/V gather."""
        return self.q_norm is not None and self.sequence_shard is None

    def _prologue_and_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(b, s, a_local, d) queries, (b, s, kv_local, d) keys and values -> (b, a_local, s, d) attention output."""
        shard = self.sequence_shard
        whole = self._whole()
        with _attention_prologue(whole):
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, heads, s, d)
            if self.rotary:
                positions = shard.positions(q.device) if shard is not None else None
                q, k = _rotate(q, positions), _rotate(k, positions)
            mask = None
            if shard is not None:  # context parallelism: keys and values of the whole sequence, (b, kv_local, S, d)
                k, v = shard.gather(k), shard.gather(v)
                mask = shard.causal_mask(q.device) if self.causal else None
        # selective recomputation of the core alone keeps its inputs (Korthikanti et al. 2022, Sec. 5)
        return _recomputed(_attention_core, self.recompute_core and not whole, q, k, v, self.causal, mask)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, Sec. 2.1; DeepSeek-V3 Sec. 2.1.1).

    Queries: ``wq_a`` (h -> q_lora_rank), RMSNorm, ``wq_b`` (-> heads x (nope + rope)); or one ``wq`` when
    q_lora_rank is unset. Keys and values: ``wkv_a`` (h -> kv_lora_rank + rope), the latent part RMSNormed
    and expanded by ``wkv_b`` (-> heads x (nope + v)); the rope part is one rotary key shared by all heads.
    Head count is read from the tensors (tensor parallelism shards wq_b/wq, wkv_b and wo by heads).
    """

    def __init__(self, spec: TransformerSpec):
        super().__init__()
        h, a = spec.hidden_size, spec.num_attention_heads
        self.nope, self.rope, self.v_dim = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.kv_rank = spec.kv_lora_rank
        qk = self.nope + self.rope
        if spec.q_lora_rank:
            self.wq_a = nn.Linear(h, spec.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(spec.q_lora_rank, eps=1e-6)
            self.wq_b = nn.Linear(spec.q_lora_rank, a * qk, bias=False)
        else:
            self.wq = nn.Linear(h, a * qk, bias=False)
        self.wkv_a = nn.Linear(h, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, eps=1e-6)
        self.wkv_b = nn.Linear(self.kv_rank, a * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(a * self.v_dim, h, bias=False)
        # the executor's hook on the rotary key every head shares (tensor parallelism sums its gradient)
        self.shared_key: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.sequence_shard: SequenceShard | None = None  # context parallelism (the executor sets it)
        self.recompute_core = False  # selective recomputation (the executor sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape  # (b, s, h)
        shard = self.sequence_shard
        positions = shard.positions(x.device) if shard is not None else None
        q_latent = self.wq_a(x) if hasattr(self, "wq_b") else x  # (b, s, q_lora_rank) or (b, s, h)
        latent, k_pe = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)  # (b, s, kv_rank), (b, s, rope)
        k_pe = _rotate(k_pe.unsqueeze(1), positions)  # (b, 1, s, rope): one rotary key for every head
        if self.shared_key is not None:
            k_pe = self.shared_key(k_pe)
        y = _recomputed(self._prologue_and_core, self.recompute_core and self._whole(), q_latent, latent, k_pe,
                        positions)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))  # (b, s, h)

    def _whole(self) -> bool:
        """Is the prologue (latent norms, up-projections: Megatron-Core's mla_up_proj) recomputed with the core, from
        the latents, in one checkpoint? Not around context parallelism's K/V gather."""
        return self.sequence_shard is None

    def _prologue_and_core(self, q_latent: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                           positions: torch.Tensor | None) -> torch.Tensor:
        """(b, s, q_lora_rank) query latents, (b, s, kv_rank) key/value latents, (b, 1, s, rope) rotated shared
        key -> (b, a_local, s, v_head) attention output."""
        b, s, _ = latent.shape
        shard = self.sequence_shard
        whole = self._whole()
        with _attention_prologue(whole):  # latents -> per-head queries, keys and values
            q = self.wq_b(self.q_norm(q_latent)) if hasattr(self, "wq_b") else self.wq(q_latent)  # (b, s, a·qk)
            q = q.view(b, s, -1, self.nope + self.rope).transpose(1, 2)  # (b, a_local, s, nope+rope)
            q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
            kv = self.wkv_b(self.kv_norm(latent)).view(b, s, -1, self.nope + self.v_dim).transpose(1, 2)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (b, a_local, s, nope), (b, a_local, s, v)
            q = torch.cat([q_nope, _rotate(q_pe, positions)], dim=-1)  # (b, a_local, s, nope+rope)
            k = torch.cat([k_nope, k_pe.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        mask = None
        if shard is not None:  # context parallelism: keys and values of the whole sequence, (b, a_local, S, .)
            k, v, mask = shard.gather(k), shard.gather(v), shard.causal_mask(latent.device)
        return _recomputed(_attention_core, self.recompute_core and not whole, q, k, v, True, mask)


class MLP(nn.Module):
    """GELU MLP (gpt, bert): fc2(gelu(fc1 x)); SwiGLU (llama): w2(silu(w1 x) * w3 x).

    ``ffn`` overrides the width and ``bias`` the family's biases (shared experts: moe width, no biases)."""

    def __init__(self, spec: TransformerSpec, ffn: int | None = None, bias: bool | None = None):
        super().__init__()
        h, f = spec.hidden_size, ffn or spec.ffn_size
        self.gated = spec.family == "llama"
        if self.gated:
            self.w1 = nn.Linear(h, f, bias=False)
            self.w3 = nn.Linear(h, f, bias=False)
            self.w2 = nn.Linear(f, h, bias=False)
        else:
            bias = True if bias is None else bias
            self.fc1 = nn.Linear(h, f, bias=bias)
            self.fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., h) -> (..., h)
        if self.gated:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def _norm(spec: TransformerSpec) -> nn.Module:
    if spec.family == "llama":
        return RMSNorm(spec.hidden_size, eps=1e-5)
    return nn.LayerNorm(spec.hidden_size, eps=1e-5)


class TransformerLayer(nn.Module):
    """Pre-norm (gpt, llama) or post-norm (bert) transformer layer; layer ``index`` of a mixture of experts
    past its dense_layers holds an MoE block (``moe``) instead of the dense MLP (``mlp``)."""

    def __init__(self, spec: TransformerSpec, index: int = 0):
        super().__init__()
        self.post_norm = spec.family == "bert"
        self.attn_norm = _norm(spec)
        self.attn = LatentAttention(spec) if spec.mla else Attention(spec)
        self.mlp_norm = _norm(spec)
        if spec.is_moe_layer(index):
            shared = MLP(spec, ffn=spec.num_shared_experts * spec.moe_ffn_size, bias=False) \
                if spec.num_shared_experts else None
            self.moe = MoE(spec, shared)
            self.ffn_name = "moe"
        else:
            self.mlp = MLP(spec)
            self.ffn_name = "mlp"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h) -> (b, s, h)
        ffn = getattr(self, self.ffn_name)
        if self.post_norm:
            x = self.attn_norm(x + self.attn(x))
            return self.mlp_norm(x + ffn(x))
        x = x + self.attn(self.attn_norm(x))
        return x + ffn(self.mlp_norm(x))


class Embedding(nn.Module):
    """Token embedding, plus learned positions (gpt, bert), token types and a LayerNorm (bert)."""

    def __init__(self, spec: TransformerSpec):
        super().__init__()
        self.tok = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.pos = nn.Embedding(spec.seq_length, spec.hidden_size) if spec.family != "llama" else None
        self.token_type = nn.Embedding(2, spec.hidden_size) if spec.family == "bert" else None
        self.norm = nn.LayerNorm(spec.hidden_size, eps=1e-5) if spec.family == "bert" else None
        self.sequence_shard: SequenceShard | None = None  # context parallelism: tokens at these positions

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (b, s) int64 -> (b, s, h)
        x = self.tok(tokens)
        shard = self.sequence_shard
        positions = shard.positions(tokens.device) if shard is not None else \
            torch.arange(tokens.shape[1], device=tokens.device)  # (s,)
        if self.pos is not None:
            x = x + self.pos(positions)
        if self.token_type is not None:
            x = x + self.token_type(torch.zeros_like(positions))  # one segment: type 0 everywhere
        if self.norm is not None:
            x = self.norm(x)
        return x


class LMHead(nn.Module):
    """Final norm (gpt, llama) or BERT's MLM transform (dense, GELU, LayerNorm), then the vocabulary
    projection ``proj`` (tied to the token embedding where the spec says so)."""

    def __init__(self, spec: TransformerSpec):
        super().__init__()
        h = spec.hidden_size
        self.transform = nn.Linear(h, h) if spec.family == "bert" else None
        self.norm = _norm(spec)
        self.proj = nn.Linear(h, spec.vocab_size, bias=spec.family == "bert")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h) -> (b, s, V)
        if self.transform is not None:
            x = F.gelu(self.transform(x))
        return self.proj(self.norm(x))


class Transformer(StagedModel):
    """A GPT, LLaMA or BERT language model: embed -> layers -> head."""

    def __init__(self, spec: TransformerSpec):
        super().__init__()
        self.spec = spec
        self.embed = Embedding(spec)
        self.layers = nn.ModuleDict({str(i): TransformerLayer(spec, i) for i in range(spec.num_layers)})
        self.head = LMHead(spec)
        if spec.tied:
            self.head.proj.weight = self.embed.tok.weight
        self.block_names = ["embed", *[f"layers.{i}" for i in range(spec.num_layers)], "head"]
        # MoE layers are "transformer_layer" too: the planner prices every layer of that kind alike (FSDP unit,
        # dropout of unfused attention); a layer's experts show in its profile (LayerProfile.expert_params).
        self.block_kinds = {n: "transformer_layer" for n in self.block_names}
        self.block_kinds.update(embed="embedding", head="lm_head")


def transformer_tp_plan(spec: TransformerSpec) -> dict[str, str]:
    """Megatron-LM tensor parallelism (Shoeybi et al. 2019, Fig. 3) as FQN pattern -> style.

    Styles: ``colwise`` / ``rowwise`` linears (one all-reduce after each rowwise linear in forward,
    one before each colwise group in backward); ``vocab_embedding`` (embedding sharded over the
    vocabulary); ``vocab_head`` (output projection sharded over the vocabulary); ``norm`` (replicated,
    or sequence-parallel when the plan turns sequence parallelism on, Korthikanti et al. 2022);
    ``region`` marks a module whose input is all-gathered over the sequence under sequence parallelism;
    ``replicated``: a module inside a region that every rank runs whole (the executor leaves it as it is).

    Multi-head latent attention shards by heads: ``wq_b`` (or ``wq``) and ``wkv_b`` colwise, ``wo`` rowwise;
    its low-rank down-projections ``wq_a``/``wkv_a`` and their norms are replicated, though inside the attention
    region: this executor and torchtitan run them on the gathered sequence, whole; Megatron-Core duplicates them
    too, on each rank's sequence shard under sequence parallelism (the cost model divides them there:
    Framework.mla_tp_input "latent"). Qwen3's q_norm/k_norm act per head (on each
    rank's own heads) with one weight shared by all heads.

    MoE blocks (``layers.N.moe``: router, experts, shared experts) have no style: they stay replicated
    under tensor parallelism. The block is token-wise, so with sequence parallelism each rank routes its
    own sequence shard (Megatron-Core with etp = 1 and sequence parallelism); without it every rank
    computes the whole block. Expert tensor parallelism (etp) and expert parallelism are the executor's
    to add, through ``MoE.dispatch`` and the stacked (E, in, out) expert weights.
    """
    plan = {"embed.tok": "vocab_embedding", "head.norm": "norm", "head.proj": "vocab_head"}
    attn_in = ("wq_b", "wq", "wkv_b") if spec.mla else ("wq", "wk", "wv")
    mlp_in, mlp_out = (("w1", "w3"), "w2") if spec.family == "llama" else (("fc1",), "fc2")
    plan.update({"layers.*.attn_norm": "norm", "layers.*.mlp_norm": "norm", "layers.*.attn": "region",
                 "layers.*.mlp": "region", "layers.*.attn.wo": "rowwise", f"layers.*.mlp.{mlp_out}": "rowwise"})
    plan.update({f"layers.*.attn.{n}": "colwise" for n in attn_in})
    plan.update({f"layers.*.mlp.{n}": "colwise" for n in mlp_in})
    if spec.mla:  # whole on every rank, though inside the attention region: not divided by the profile's tp views
        plan.update({f"layers.*.attn.{n}": "replicated" for n in ("wq_a", "q_norm", "wkv_a", "kv_norm")})
    return plan


def transformer_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy. logits: (b, s, V), targets: (b, s)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def transformer_batch(spec: TransformerSpec, batch: int, generator: torch.Generator,
                      seq_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens (b, s) and next-token targets (b, s), for profiling and smoke tests."""
    s = seq_length or spec.seq_length
    tokens = torch.randint(0, spec.vocab_size, (batch, s + 1), generator=generator)
    if spec.family == "bert":  # masked-LM style: corrupt every 7th token, predict the originals
        inputs = tokens[:, :s].clone()
        inputs[:, ::7] = 0
        return inputs, tokens[:, :s]
    return tokens[:, :s], tokens[:, 1:]
