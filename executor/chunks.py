"""This rank's model chunks: the whole model built on the meta device, cut by the plan's module lists.

A pipeline rank holds one chunk per (virtual) stage it runs: stage ``s`` runs on pipeline rank
``stage_rank(schedule, s, pp)`` (round-robin for interleaved 1F1B, a V for ZB-V; planner/schedules.py
decides, the executor follows). Each chunk is the full model with every other block deleted, so
module names (FQNs) stay those of the whole model and the plan's lists keep working.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paraplan.models import ModelSpec, StagedModel, build_model, parameter_generator, reference_init, tied_aliases
from paraplan.planner.schedules import stage_rank


@dataclass
class Chunk:
    """One (virtual) pipeline stage held by this rank."""

    stage: int  # index in the pipeline, 0 .. pp * virtual_stages - 1
    module: StagedModel
    blocks: list[str]


def local_stages(schedule: str, pp_rank: int, pp: int, num_stages: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` runs, ascending (the order torch's schedules expect)."""
    return [s for s in range(num_stages) if stage_rank(schedule, s, pp) == pp_rank]


def build_chunks(spec: ModelSpec, stages: list[list[str]], schedule: str, pp_rank: int, pp: int) -> list[Chunk]:
    """This rank's chunks on the meta device (no memory yet): one per local stage."""
    chunks = []
    for s in local_stages(schedule, pp_rank, pp, len(stages)):
        module = build_model(spec, "meta")
        module.keep_only(stages[s])
        chunks.append(Chunk(stage=s, module=module, blocks=list(stages[s])))
    return chunks


def materialize(module: nn.Module, spec: ModelSpec, seed: int, device: torch.device) -> None:
    """Allocate ``module`` on ``device`` and give every parameter its reference value.

    The value of a parameter is drawn in full from (seed, FQN in the whole model) exactly as
    :func:`paraplan.models.initialize` draws it, then a tensor-parallel (DTensor) parameter keeps its
    own shard of it. So weights never depend on the layout; a tied LM head that sits in another
    stage than the embedding starts from the embedding's value (Megatron's tied copies).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    module.to_empty(device=device)
    retie(module, spec)
    aliases = tied_aliases(spec)
    with torch.no_grad():
        for mod_name, mod in module.named_modules():
            for pname, p in mod.named_parameters(recurse=False):
                fqn = canonical_fqn(f"{mod_name}.{pname}" if mod_name else pname)
                full = reference_init(mod, pname, p.shape, parameter_generator(seed, aliases.get(fqn, fqn)))
                if isinstance(p, DTensor):  # keep this rank's shard of the full value, no communication
                    shard = distribute_tensor(full.to(device), p.device_mesh, p.placements, src_data_rank=None)
                    p.to_local().copy_(shard.to_local())
                else:
                    p.copy_(full)
            if isinstance(mod, nn.BatchNorm2d):
                mod.reset_running_stats()


def canonical_fqn(fqn: str) -> str:
    """The whole model's name of a parameter, without the wrappers' levels (activation checkpointing
    wraps modules before they are materialised)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    return fqn.replace(_CHECKPOINT_PREFIX, "")


def retie(module: nn.Module, spec: ModelSpec) -> None:
    """Tie the LM head to the embedding again where the chunk holds both: ``to_empty`` (from meta) and
    ``parallelize_module`` each give the two modules separate new parameters. Under tensor
    parallelism both are sharded over the vocabulary (dim 0) alike, so they stay one tensor."""
    for alias, target in tied_aliases(spec).items():
        try:
            src = module.get_parameter(target)
            owner_name, _, pname = alias.rpartition(".")
            owner = module.get_submodule(owner_name)
            dst = module.get_parameter(alias)
        except AttributeError:
            continue  # the chunk holds at most one of the pair: tied copies are synchronised elsewhere
        if getattr(dst, "placements", None) != getattr(src, "placements", None):
            raise AssertionError(f"{alias} and {target} are sharded differently; cannot tie them")
        setattr(owner, pname, src)
