"""A module made of an ordered list of pipeline-splittable blocks, addressed by module name.

Every model in the zoo derives from :class:`StagedModel`. Its forward runs the blocks that are
present in order, so cutting the model to a pipeline stage is just deleting the other blocks
(torchtitan's approach: module names stay stable, so the plan's FQN lists keep working).
"""

from __future__ import annotations

import torch
from torch import nn


class StagedModel(nn.Module):
    """Base class: subclasses register their blocks and list them in ``block_names``."""

    block_names: list[str]
    block_kinds: dict[str, str]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.present_blocks():
            x = self.get_submodule(name)(x)
        return x

    def present_blocks(self) -> list[str]:
        """The blocks still held (all of them until :meth:`keep_only` cut the model)."""
        out = []
        for name in self.block_names:
            try:
                self.get_submodule(name)
            except AttributeError:
                continue
            out.append(name)
        return out

    def keep_only(self, names: list[str]) -> None:
        """Delete every block not in ``names`` (this rank's pipeline stage); names keep their FQNs."""
        unknown = [n for n in names if n not in self.block_names]
        assert not unknown, f"not blocks of this model: {unknown}"
        for name in self.block_names:
            if name in names:
                continue
            parent_name, _, child = name.rpartition(".")
            parent = self.get_submodule(parent_name) if parent_name else self
            if isinstance(parent, nn.ModuleDict):
                del parent[child]
            else:
                delattr(parent, child)
