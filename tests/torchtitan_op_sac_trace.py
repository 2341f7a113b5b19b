"""What torchtitan's own Llama block keeps and reruns under its own per-op selective checkpoint, traced on CPU (for
tests/test_frameworks.py, in a process of its own: torchtitan imports here through stand-ins for its training-only
dependencies, tests/torchtitan_ranks.install_stand_ins).

The block is torchtitan's llama3 TransformerBlock; the policy is torchtitan's ``_apply_op_sac`` with the llama3
``_op_sac_save_list``, plus the CPU flash-attention kernel this machine runs in place of the CUDA one the list names.
Prints one JSON object: the bytes the block keeps after its forward (the executor's RankTrace: storages created in
the forward and still alive, the parameters, the rotary table and the block's output left out; the input existed
before the trace), with the policy and without checkpointing, and the matmul and attention FLOPs of the backward
(recomputation included) each way.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from torchtitan_ranks import install_stand_ins  # noqa: E402

install_stand_ins()

import torch  # noqa: E402
from torchtitan.config import ActivationCheckpoint  # noqa: E402
from torchtitan.distributed.activation_checkpoint import _apply_op_sac  # noqa: E402
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list  # noqa: E402
from torchtitan.models.llama3.model.args import TransformerModelArgs  # noqa: E402
from torchtitan.models.llama3.model.model import TransformerBlock, precompute_freqs_cis  # noqa: E402

from paraplan.executor.trace import RankTrace, storage_key  # noqa: E402

SHAPE = dict(dim=256, n_heads=8, n_kv_heads=4, multiple_of=64)  # FFN: 2/3 of 4h rounded up to 64 -> 704
BATCH, SEQ = 2, 64


def main() -> None:
    torch.manual_seed(0)
    args = TransformerModelArgs(n_layers=2, vocab_size=1000, max_seq_len=128, **SHAPE)
    block = TransformerBlock(1, args)  # fp32 on CPU
    with torch.no_grad():
        block.init_weights()
    save = set(_op_sac_save_list) | {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    checkpointed = _apply_op_sac(block, ActivationCheckpoint(mode="selective", selective_ac_option="op"),
                                 op_sac_save_list=save)
    freqs = precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)[:SEQ]
    x = torch.randn(BATCH, SEQ, args.dim, requires_grad=True)  # (b, s, h)
    skip = {storage_key(p.untyped_storage()) for p in block.parameters()} | {storage_key(freqs.untyped_storage())}
    out = {"tokens": BATCH * SEQ, "ffn": block.feed_forward.w1.weight.shape[0]}
    for name, module in (("op_sac", checkpointed), ("none", block)):
        gc.collect()
        with RankTrace() as forward:
            y = module(x, freqs, None)  # (b, s, h)
            gc.collect()
            mine = skip | {storage_key(y.untyped_storage())}
            out[f"kept_{name}"] = sum(n for key, n in forward.live.items() if key not in mine)
        with RankTrace() as backward:
            y.sum().backward()
        out[f"backward_flops_{name}"] = backward.flops
        del y
    print(json.dumps(out))


if __name__ == "__main__":
    main()
