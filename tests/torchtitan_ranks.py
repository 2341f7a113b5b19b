"""Ranks of tests/test_export.py's torchtitan gpt check: executor/torchtitan_gpt.py's parallelize_gpt on two
CPU processes (gloo) against the same model on one, for tensor parallelism (tp 2) and FSDP2 (dp_shard 2)."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os
import sys
import types
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawned_rank import exit_passed_rank

# torchtitan's data, tokenizer and metrics plumbing needs packages its CPU test install lacks (tokenizers, datasets,
# torchdata, tensorboard), and its MoE kernels need triton: stand-ins where those do not import, so that the
# models, their args and train specs (all real) import.
STAND_INS = ("torchtitan.components.tokenizer", "torchtitan.components.dataloader", "torchtitan.components.metrics",
             "torchtitan.hf_datasets.text_datasets", "torchtitan.models.moe.kernels")


def bare_package() -> None:
    """torchtitan's package without its __init__ (which needs its training deps)."""
    if "torchtitan" not in sys.modules:
        package = types.ModuleType("torchtitan")
        package.__path__ = list(importlib.util.find_spec("torchtitan").submodule_search_locations)
        sys.modules["torchtitan"] = package


def install_stand_ins() -> None:
    """:func:`bare_package`, then modules whose every attribute is an empty class where the real one does not
    import."""
    bare_package()

    def placeholder(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (), {})

    for name in STAND_INS:
        try:
            importlib.import_module(name)
        except ImportError:
            module = types.ModuleType(name)
            module.__getattr__ = placeholder
            sys.modules[name] = module


def gpt_rank(rank: int, port: int, mode: str) -> None:
    """One of two ranks: ``mode`` "tp" (both ranks take the whole batch) or "fsdp" (each half of it). The
    parallelized model's logits and its gradients (gathered: DTensors' full tensors) must equal the single-process
    model's for the global batch's mean token loss (tied head and embedding, learned positions included)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        install_stand_ins()
        import torchtitan.distributed.parallel_dims as parallel_dims
        from torchtitan.config import JobConfig

        from paraplan.executor.torchtitan_gpt import GPT, GPTArgs, parallelize_gpt

        parallel_dims.device_type = "cpu"  # torchtitan's meshes default to CUDA where no accelerator is found
        args = GPTArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, max_seq_len=16)
        torch.manual_seed(0)
        model = GPT(args)
        model.init_weights()
        reference = copy.deepcopy(model)
        reference.output.weight = reference.tok_embeddings.weight  # deepcopy keeps the tie; said, not assumed
        cfg = JobConfig()
        cfg.training.mixed_precision_param = cfg.training.mixed_precision_reduce = "float32"
        cfg.parallelism.disable_loss_parallel = True
        tp = 2 if mode == "tp" else 1
        dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=2 // tp, cp=1, tp=tp, pp=1, ep=1, etp=1,
                                          world_size=2)
        dims.build_mesh()
        parallelize_gpt(model, dims, cfg)

        # (b, s), the same on both ranks: from a generator of its own (parallelizing may draw from the global one)
        tokens = torch.randint(0, args.vocab_size, (4, args.max_seq_len), generator=torch.Generator().manual_seed(1))
        targets = torch.roll(tokens, -1, dims=1)
        mine = slice(None) if mode == "tp" else slice(2 * rank, 2 * rank + 2)  # FSDP: each rank half the batch

        def mean_loss(logits: torch.Tensor, part: slice) -> torch.Tensor:  # summed over this part / all tokens
            flat = logits.reshape(-1, args.vocab_size)  # (b·s, V)
            return F.cross_entropy(flat, targets[part].reshape(-1), reduction="sum") / targets.numel()

        logits = model(tokens[mine])  # (b_local, s, V)
        want = reference(tokens)
        torch.testing.assert_close(logits, want[mine], rtol=1e-5, atol=1e-5)
        mean_loss(logits, mine).backward()
        mean_loss(want, slice(None)).backward()
        expected = dict(reference.named_parameters())
        for name, param in model.named_parameters():  # torchtitan's default activation checkpointing wraps layers
            name = name.replace("_checkpoint_wrapped_module.", "")
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            torch.testing.assert_close(grad, expected[name].grad, rtol=1e-4, atol=1e-6, msg=f"{mode}: {name}")
        assert model.output.weight is model.tok_embeddings.weight  # still one parameter
    finally:
        dist.destroy_process_group()
    exit_passed_rank()
