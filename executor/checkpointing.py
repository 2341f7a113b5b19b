"""Activation recomputation per the plan, with torch.utils.checkpoint (non-reentrant).

- ``full``: each transformer layer keeps only its input; its whole forward runs again in backward.
- ``mlp``: each transformer layer's MLP sublayer (its dense MLP, or its MoE block with the token all-to-alls)
  keeps only its input and runs again in backward (Megatron-Core's ``recompute_modules`` ``mlp`` / ``moe``).
- ``selective`` (Korthikanti et al. 2022): only the attention core, softmax(QK^T)V, is recomputed.
  Each layer's attention module runs under selective activation checkpointing whose policy saves
  every op's output except those executed inside the attention core (the model flags that region,
  see ``paraplan.models.in_attention_core``), which are recomputed; so is the attention's prologue where
  it has one (``in_attention_prologue``): multi-head latent attention's latent norms and up-projection
  into per-head queries, keys and values (Megatron-Core's ``mla_up_proj``, which DeepSeek-V3's recipes
  recompute), Qwen3's per-head query/key norms. (Wrapping the attention module rather than the whole
  layer keeps the layer's norms, whose kernels update tensors in place, out of the cached region; the
  norms inside the attention are in its prologue, recomputed, for the same reason.)

Modules are wrapped in place (``layers[i]``, ``layers[i].attn`` or ``layers[i].mlp``/``.moe``), so block names
still resolve.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from paraplan.models import in_attention_core, in_attention_prologue

from .errors import ExecutionError


def _recompute_attention_core(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    recompute = in_attention_core() or in_attention_prologue()
    return CheckpointPolicy.PREFER_RECOMPUTE if recompute else CheckpointPolicy.MUST_SAVE


def _wrapper(mode: str):
    if mode in ("full", "mlp"):
        return partial(checkpoint_wrapper, checkpoint_fn=checkpoint, use_reentrant=False, preserve_rng_state=False)
    if mode == "selective":
        contexts = partial(create_selective_checkpoint_contexts, _recompute_attention_core)
        return partial(checkpoint_wrapper, checkpoint_fn=checkpoint, use_reentrant=False, preserve_rng_state=False,
                       context_fn=contexts)
    raise ExecutionError(f"unknown recompute mode {mode!r} (none, selective, mlp or full)")


def apply_ac(module: nn.Module, mode: str) -> int:
    """Wrap ``module``'s transformer layers (full), their attention (selective) or their MLP sublayer (mlp);
    returns how many layers."""
    if mode == "none":
        return 0
    layers = getattr(module, "layers", None)
    if not isinstance(layers, nn.ModuleDict):  # a chunk of only the embedding or the head
        return 0
    wrap = _wrapper(mode)
    for name in list(layers.keys()):
        if mode == "full":
            layers[name] = wrap(layers[name])
        elif mode == "mlp":
            ffn = layers[name].ffn_name  # models/transformer.py: "mlp" (dense) or "moe"
            setattr(layers[name], ffn, wrap(getattr(layers[name], ffn)))
        else:
            layers[name].attn = wrap(layers[name].attn)
    return len(layers)
