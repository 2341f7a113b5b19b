"""A multi-layer perceptron classifier made of pipeline-splittable blocks.

Blocks: ``layers.0`` ... (Linear + ReLU each), ``head`` (the classifier ``head.fc``).
"""

from __future__ import annotations

import torch
from torch import nn

from .cnn import FC, ClassifierHead
from .specs import MLPSpec
from .staged import StagedModel


class MLP(StagedModel):
    def __init__(self, spec: MLPSpec):
        super().__init__()
        self.spec = spec
        widths = [spec.input_size, *spec.hidden_sizes]
        self.layers = nn.ModuleDict({str(i): FC(widths[i], widths[i + 1]) for i in range(len(spec.hidden_sizes))})
        self.head = ClassifierHead(widths[-1], spec.num_classes, pool=False)
        self.block_names = [f"layers.{i}" for i in range(len(spec.hidden_sizes))] + ["head"]
        self.block_kinds = {n: "linear" for n in self.block_names}
        self.block_kinds["head"] = "classifier"


def feature_batch(spec: MLPSpec, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic feature vectors (b, input_size) and labels (b,)."""
    x = torch.randn(batch, spec.input_size, generator=generator)
    return x, torch.randint(0, spec.num_classes, (batch,), generator=generator)
