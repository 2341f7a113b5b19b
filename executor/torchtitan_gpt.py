"""paraplan's gpt family as a torchtitan 0.2.2 model, so that ``export --to torchtitan`` can train a GPT plan.

torchtitan 0.2.2's decoders (llama3, llama4, qwen3, deepseek_v3, gpt_oss) all use RoPE, RMSNorm and SwiGLU; a
paraplan gpt model (models/transformer.py: GPT-2 / Megatron-LM's GPT) has learned position embeddings, LayerNorm,
a GELU (tanh) MLP, biases on every linear but the head, and its head tied to the token embedding unless the spec
says otherwise. :class:`GPT` is that model — same parameters, same numerics (a test copies paraplan's weights
into it and compares the logits) — under torchtitan's module names (``tok_embeddings``, ``layers.N`` with
``attention_norm``, ``attention.wq/wk/wv/wo``, ``ffn_norm``, ``feed_forward.w1/w2``, then ``norm``, ``output``)
plus ``pos_embeddings``, so that torchtitan's activation checkpointing, DDP and pipeline split apply as they do to
its llama3. :func:`parallelize_gpt` is torchtitan's parallelize_llama for this model: Megatron's tensor-parallel
plan with sequence parallelism (llama3's, the GELU MLP's two linears for SwiGLU's three, the learned positions
sharded over the sequence like the token embeddings) and FSDP2 per layer with the embeddings, final norm and head
in the root unit (one unit holds a tied weight once). :func:`gpt_train_spec` is llama3's train spec (optimizer,
schedule, data, tokenizer, loss) with this model.

Not expressed: context parallelism (a learned position embedding needs each token's global position, which
torchtitan's load-balanced sequence split does not hand the model), and a tied head with pipeline parallelism
(its two ends are on different stages): the export refuses both. This module imports torchtitan; only the module
an export writes imports it, on the machines that run torchtitan (paraplan installed there too).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list as SAC_SAVE  # selective AC's kept ops
from torchtitan.models.llama3.infra.parallelize import apply_ddp, disable_fsdp_gradient_division
from torchtitan.protocols.model import BaseModelArgs, ModelProtocol
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec

INIT_STD = 0.02  # GPT-2's initialisation (normal, std 0.02; biases zero)


@dataclass
class GPTArgs(BaseModelArgs):
    """A gpt model's shape (paraplan's TransformerSpec fields of the gpt family)."""

    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int = 12
    ffn_dim: int = 3072
    vocab_size: int = 50257
    max_seq_len: int = 1024  # learned positions: the embedding's rows
    norm_eps: float = 1e-5
    tied: bool = True  # the head's weight is the token embedding's

    def update_from_config(self, job_config, **kwargs) -> None:
        """torchtitan's hook before the model is built: a learned position table cannot grow, so a longer
        training.seq_len is an error (llama3 only warns: RoPE extends)."""
        seq = job_config.training.seq_len
        if seq > self.max_seq_len:
            raise ValueError(f"training.seq_len {seq} exceeds the model's {self.max_seq_len} learned positions "
                             "(max_seq_len)")
        if job_config.parallelism.context_parallel_degree > 1:
            raise ValueError("context parallelism is not supported for paraplan's gpt models (learned positions "
                             "need each token's global position)")
        if self.tied and job_config.parallelism.pipeline_parallel_degree > 1:
            raise ValueError("a head tied to the token embedding cannot be pipelined (the two ends sit on different "
                             "stages): build the model with tied=False")

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """Parameters (a tied weight once) and training FLOPs per token: 6 per weight of every linear, the head
        included even when tied (Kaplan et al. 2020's 6N, embeddings' lookups left out), plus attention's
        6·layers·heads·2·head_dim·seq (torchtitan's convention: causal sparsity not taken off)."""
        params = sum(p.numel() for p in model.parameters())
        linear = sum(p.numel() for name, p in model.named_parameters(remove_duplicate=False)
                     if not name.startswith(("tok_embeddings.", "pos_embeddings.")))
        head_dim = self.dim // self.n_heads
        return params, 6 * linear + 6 * self.n_layers * self.n_heads * 2 * head_dim * seq_len


class Attention(nn.Module):
    """Causal self-attention with biased Q/K/V/O projections (grouped K/V heads where n_kv_heads < n_heads)."""

    def __init__(self, args: GPTArgs):
        super().__init__()
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h) -> (b, s, h)
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, a_local, s, d)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # (b, kv_local, s, d)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        # grouped-query attention: each K/V head serves a group of query heads, shared by the kernel (enable_gqa)
        grouped = k.shape[1] != q.shape[1]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)  # (b, a_local, s, d)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))

    def init_weights(self, std: float) -> None:
        for linear in (self.wq, self.wk, self.wv, self.wo):
            nn.init.normal_(linear.weight, std=std)
            nn.init.zeros_(linear.bias)


class FeedForward(nn.Module):
    """GELU MLP: w2(gelu_tanh(w1 x)), both linears biased."""

    def __init__(self, args: GPTArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim)
        self.w2 = nn.Linear(args.ffn_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., h) -> (..., h)
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))

    def init_weights(self, std: float) -> None:
        for linear in (self.w1, self.w2):
            nn.init.normal_(linear.weight, std=std)
            nn.init.zeros_(linear.bias)


class TransformerBlock(nn.Module):
    """Pre-norm GPT layer: x + attention(LN x), then + MLP(LN x)."""

    def __init__(self, args: GPTArgs):
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, h) -> (b, s, h)
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(INIT_STD)
        self.feed_forward.init_weights(INIT_STD)


class GPT(ModelProtocol):
    """tok_embeddings + pos_embeddings -> layers -> norm -> output. A pipeline stage holds some of these (the
    others None, as torchtitan's pipeline split leaves them): a stage without the embeddings takes hidden states."""

    def __init__(self, args: GPTArgs):
        super().__init__(args)
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = nn.LayerNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tied:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """GPT-2's initialisation; the head keeps the token embedding's weight where tied (re-tied: built on the
        meta device and moved, the two may have come apart)."""
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=INIT_STD)
        if self.pos_embeddings is not None:
            nn.init.normal_(self.pos_embeddings.weight, std=INIT_STD)
        for layer in self.layers.values():
            if layer is not None:
                layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            if self.model_args.tied and self.tok_embeddings is not None:
                self.output.weight = self.tok_embeddings.weight
            else:
                nn.init.normal_(self.output.weight, std=INIT_STD)

    def forward(self, tokens: torch.Tensor, attention_masks=None, positions=None) -> torch.Tensor:
        """(b, s) token ids (or (b, s, h) hidden states on a later pipeline stage) -> (b, s, V) logits (or hidden
        states where the stage has no head)."""
        if self.tok_embeddings is not None and self.pos_embeddings is None:  # a stage list without pos_embeddings
            raise ValueError("the first pipeline stage needs pos_embeddings beside tok_embeddings "
                             "(parallelism.module_fqns_per_model_part)")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (b, s, h)
        if self.pos_embeddings is not None:
            where = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)  # (1, s)
            h = h + self.pos_embeddings(where)  # (1, s, h) broadcast over the batch
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def parallelize_gpt(model: GPT, parallel_dims, job_config) -> GPT:
    """torchtitan's parallelize_llama for :class:`GPT`: tensor (and sequence) parallelism, activation
    checkpointing, then FSDP2 or DDP. (torch.compile is left to torchtitan's llama3: not applied here.)"""
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.get_mesh("tp"), loss_parallel=not job_config.parallelism.disable_loss_parallel)
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint, model_compile_enabled=False, op_sac_save_list=SAC_SAVE,
                 base_folder=job_config.job.dump_folder)
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(model, parallel_dims.get_mesh(names),
                   MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
                                        reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce]),
                   reshard_policy=job_config.parallelism.fsdp_reshard_after_forward, pp=parallel_dims.pp_enabled)
    elif parallel_dims.dp_replicate_enabled:
        mesh = parallel_dims.get_mesh("dp_replicate")
        if parallel_dims.world_size != mesh.size():
            raise RuntimeError("DDP has not supported > 1D parallelism")
        apply_ddp(model, mesh, enable_compile=False)
    return model


def apply_tp(model: GPT, tp_mesh, loss_parallel: bool) -> None:
    """Megatron's tensor-parallel plan with sequence parallelism: Q/K/V and the MLP's first linear split by
    columns, the attention output and the MLP's second by rows (their outputs reduce-scattered over the sequence),
    the norms sequence-parallel, the embeddings' outputs scattered over the sequence, the head split over the
    vocabulary. A tied head and embedding split their weight alike (Shard(0), vocabulary rows): re-tied after."""
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           "norm": SequenceParallel(),
           "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                     use_local_output=not loss_parallel)}
    parallelize_module(model, tp_mesh, {k: v for k, v in top.items() if getattr(model, k) is not None})
    if model.model_args.tied and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def apply_fsdp(model: GPT, mesh, mp_policy: MixedPrecisionPolicy, reshard_policy: str, pp: bool) -> None:
    """FSDP2: one unit per layer, the rest (embeddings, final norm, head) in the root unit. ``reshard_policy``:
    torchtitan's fsdp_reshard_after_forward ("default": reshard unless pipelining, "always", "never")."""
    reshard = {"always": True, "never": False, "default": not pp}.get(reshard_policy)
    if reshard is None:
        raise ValueError(f"Invalid reshard_after_forward_policy: {reshard_policy}.")
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    disable_fsdp_gradient_division(model)  # torchtitan's loss divides by the global token count itself
    if dist.get_backend(mesh.get_group(0)) == "gloo":  # gloo has no PREMUL_SUM (the divide factor's op): plain sums
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def gpt_train_spec(flavors: dict[str, GPTArgs]) -> TrainSpec:
    """torchtitan's llama3 train spec (pipeline split, optimizers, LR schedule, data, tokenizer, loss,
    validator) with :class:`GPT` and ``flavors``; no Hugging Face state-dict adapter (no such checkpoint)."""
    return dataclasses.replace(get_train_spec("llama3"), model_cls=GPT, model_args=flavors,
                               parallelize_fn=parallelize_gpt, state_dict_adapter=None)
