"""ResNet and VGG as pipeline-splittable blocks, with torchvision's exact layouts and parameter counts.

Blocks: ResNet ``stem``, ``layer1.0`` ... ``layer4.{n-1}`` (one residual block each), ``head``
(global pool + ``fc``); VGG ``features.{i}`` (one conv + ReLU, with the max-pool that follows it),
``classifier.0`` (adaptive pool to 7x7 + fc + ReLU), ``classifier.1`` (fc + ReLU), ``head`` (``fc``).
VGG's dropout is left out (no parameters; keeps runs deterministic).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .specs import ResNetSpec, VGGSpec
from .staged import StagedModel


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = _downsample(inplanes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, c, H, W) -> (b, c', H/stride, W/stride)
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int):
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)  # stride on the 3x3 (ResNet v1.5)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.downsample = _downsample(inplanes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        return F.relu(self.bn3(self.conv3(out)) + identity)


def _downsample(inplanes: int, outplanes: int, stride: int) -> nn.Module | None:
    if stride == 1 and inplanes == outplanes:
        return None
    return nn.Sequential(nn.Conv2d(inplanes, outplanes, 1, stride, bias=False), nn.BatchNorm2d(outplanes))


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn = nn.BatchNorm2d(64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, 3, H, W) -> (b, 64, H/4, W/4)
        return F.max_pool2d(F.relu(self.bn(self.conv(x))), 3, 2, 1)


class ClassifierHead(nn.Module):
    """Global average pool (when given feature maps) then the linear classifier ``fc``."""

    def __init__(self, in_features: int, num_classes: int, pool: bool):
        super().__init__()
        self.pool = pool
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, c, H, W) or (b, c) -> (b, classes)
        if self.pool:
            x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.fc(x)


class ResNet(StagedModel):
    def __init__(self, spec: ResNetSpec):
        super().__init__()
        self.spec = spec
        kind, counts = spec.DEPTHS[spec.depth]
        block = BasicBlock if kind == "basic" else Bottleneck
        self.stem = Stem()
        inplanes = 64
        self.block_names = ["stem"]
        for stage, (planes, n) in enumerate(zip((64, 128, 256, 512), counts, strict=True), start=1):
            blocks = nn.ModuleDict()
            for i in range(n):
                stride = 2 if (i == 0 and stage > 1) else 1
                blocks[str(i)] = block(inplanes, planes, stride)
                inplanes = planes * block.expansion
                self.block_names.append(f"layer{stage}.{i}")
            setattr(self, f"layer{stage}", blocks)
        self.head = ClassifierHead(inplanes, spec.num_classes, pool=True)
        self.block_names.append("head")
        self.block_kinds = {n: f"resnet_{kind}" for n in self.block_names}
        self.block_kinds.update(stem="conv_stem", head="classifier")


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, pool: bool):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, cin, H, W) -> (b, cout, H', W')
        x = F.relu(self.conv(x))
        return F.max_pool2d(x, 2) if self.pool else x


class PooledFC(nn.Module):
    """VGG's first classifier layer: adaptive pool to 7x7, flatten, fc, ReLU."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.fc = nn.Linear(cin * 7 * 7, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, 512, H, W) -> (b, cout)
        return F.relu(self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 7), 1)))


class FC(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.fc = nn.Linear(cin, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, cin) -> (b, cout)
        return F.relu(self.fc(x))


class VGG(StagedModel):
    def __init__(self, spec: VGGSpec):
        super().__init__()
        self.spec = spec
        cfg = spec.CONFIGS[spec.depth]
        self.features = nn.ModuleDict()
        cin = 3
        for i, c in enumerate(cfg):
            if c == "M":
                continue
            pool = i + 1 < len(cfg) and cfg[i + 1] == "M"
            self.features[str(len(self.features))] = ConvBlock(cin, c, pool)
            cin = c
        self.classifier = nn.ModuleDict({"0": PooledFC(cin, 4096), "1": FC(4096, 4096)})
        self.head = ClassifierHead(4096, spec.num_classes, pool=False)
        self.block_names = [f"features.{i}" for i in range(len(self.features))] + ["classifier.0", "classifier.1",
                                                                                  "head"]
        self.block_kinds = {n: "conv" if n.startswith("features") else "linear" for n in self.block_names}
        self.block_kinds["head"] = "classifier"


def classifier_tp_plan() -> dict[str, str]:
    """Hybrid parallelism's sharded classifier: the class dimension of ``head.fc`` split over ranks."""
    return {"head.fc": "class_sharded"}


def classifier_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean softmax cross-entropy. logits: (b, classes), labels: (b,)."""
    return F.cross_entropy(logits.float(), labels)


def image_batch(image_size: int, num_classes: int, batch: int,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic images (b, 3, H, W) and labels (b,)."""
    images = torch.randn(batch, 3, image_size, image_size, generator=generator)
    return images, torch.randint(0, num_classes, (batch,), generator=generator)
