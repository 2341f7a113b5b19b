"""Activation recomputation per the plan, with torch.utils.checkpoint (non-reentrant).

- ``full``: each transformer layer keeps only its input; its whole forward runs again in backward.
- ``mlp``: each transformer layer's MLP sublayer (its dense MLP, or its MoE block with the token all-to-alls)
  keeps only its input and runs again in backward (Megatron-Core's ``recompute_modules`` ``mlp`` / ``moe``).
- ``selective`` (Korthikanti et al. 2022): only the attention core, softmax(QK^T)V, is recomputed: the
  attention modules run it under a checkpoint that keeps its inputs (Q, K, V), as Megatron's ``core_attn``;
  where the attention has a prologue (``paraplan.models.in_attention_prologue``: multi-head latent
  attention's latent norms and up-projection, as Megatron-Core's ``mla_up_proj``, which DeepSeek-V3's
  recipes recompute; Qwen3's query/key norms) the checkpoint starts before it and keeps what it reads. (A
  plain checkpoint keeps only its inputs; torch's selective checkpointing, used before, cached the output of
  every op it did not recompute, which held more than no recomputation at all.)

- ``selective+mlp``: both (Megatron-Core's ``recompute_modules`` core_attn/mla_up_proj with mlp/moe, as NVIDIA's
  DeepSeek-V3 recipes run).

Modules are wrapped in place (``layers[i]`` or ``layers[i].mlp``/``.moe``), so block names still resolve.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

from paraplan.planner.layout import recomputes_core, recomputes_mlp

from .errors import ExecutionError


def _wrapper(mode: str):
    if mode == "full" or recomputes_mlp(mode):
        return partial(checkpoint_wrapper, checkpoint_fn=checkpoint, use_reentrant=False, preserve_rng_state=False)
    raise ExecutionError(f"unknown recompute mode {mode!r} (none, selective, mlp, selective+mlp or full)")


def apply_ac(module: nn.Module, mode: str) -> int:
    """Wrap ``module``'s transformer layers (full) or their MLP sublayer (mlp), or have their attention checkpoint
    its core (selective), or both of the last two (selective+mlp); returns how many layers."""
    if mode == "none":
        return 0
    layers = getattr(module, "layers", None)
    if not isinstance(layers, nn.ModuleDict):  # a chunk of only the embedding or the head
        return 0
    if recomputes_core(mode):  # the attention modules checkpoint their core (and prologue) themselves
        for layer in layers.values():
            layer.attn.recompute_core = True
        if not recomputes_mlp(mode):
            return len(layers)
    wrap = _wrapper(mode)
    for name in list(layers.keys()):
        if mode == "full":
            layers[name] = wrap(layers[name])
        else:  # mlp, selective+mlp
            ffn = layers[name].ffn_name  # models/transformer.py: "mlp" (dense) or "moe"
            setattr(layers[name], ffn, wrap(getattr(layers[name], ffn)))
    return len(layers)
