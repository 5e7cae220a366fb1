"""The FedBAT paper's models (Table 4): a 4-conv CNN for FMNIST/SVHN and ResNet-10 for CIFAR-10/100.

Buildable reading of Table 4 (which lists only the conv, block and linear layers):

- **CNN**: four times [Conv 3×3, padding 1, no bias → BatchNorm → ReLU → MaxPool 2×2], then Flatten and a
  bias-free Linear. The pooling is not in the table but is implied by its Linear input sizes: 28→14→7→3→1
  gives 256 features for FMNIST, 32→16→8→4→2 gives 1024 for SVHN. ``widths`` scales the channels (the
  paper's are (32, 64, 128, 256); the CPU reproduction uses a quarter of them).
- **ResNet-10**: stem Conv 3×3 (no bias) → BN → ReLU; BasicBlocks of widths (32, 64, 128, 256) with
  strides (1, 2, 2, 2), each conv3×3 → BN → ReLU → conv3×3 → BN plus a shortcut (1×1 conv + BN when the
  shape changes), then ReLU; global average pooling and a bias-free Linear. Table 4's widths are
  followed; the authors' released code uses (64, 128, 256, 512).

No layer has a bias, so the binarized tensors are exactly the conv and linear weights
(:func:`binarized_names`); BatchNorm γ/β and running statistics stay full precision. Initialisation
(unspecified in the paper; the released code's): conv and linear weights ~ N(0, 0.01²), BN γ = 1, β = 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

INIT_STD = 0.01


def _conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)


def _check_positive(name: str, values: Sequence[int]) -> None:
    if not values or any(int(v) != v or v < 1 for v in values):
        raise ValueError(f"{name} must be positive integers, got {tuple(values)}")


class Table4CNN(nn.Module):
    """The paper's CNN: ``Table4CNN(1, 10, image_size=28)`` is FMNIST's (389,920 binarized weights),
    ``Table4CNN(3, 10, image_size=32)`` is SVHN's."""

    def __init__(self, in_channels: int = 1, n_classes: int = 10, *, image_size: int = 28,
                 widths: Sequence[int] = (32, 64, 128, 256)) -> None:
        super().__init__()
        _check_positive("in_channels, n_classes, image_size", (in_channels, n_classes, image_size))
        _check_positive("widths", widths)
        layers: list[nn.Module] = []
        channels, side = in_channels, image_size
        for width in widths:
            if side < 2:
                raise ValueError(f"image_size={image_size} is too small for {len(widths)} pooling stages")
            layers += [_conv3x3(channels, width), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2)]
            channels, side = width, side // 2
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels * side * side, n_classes, bias=False)
        self.input_shape = (in_channels, image_size, image_size)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class BasicBlock(nn.Module):
    """The standard ResNet basic block (He et al. 2016) without biases."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv3x3(c_in, c_out, stride), nn.BatchNorm2d(c_out)
        self.conv2, self.bn2 = _conv3x3(c_out, c_out), nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet10(nn.Module):
    """ResNet-10 of Table 4: ``ResNet10(3, 10)`` for CIFAR-10 (1,226,080 binarized weights)."""

    def __init__(self, in_channels: int = 3, n_classes: int = 10, *, image_size: int = 32,
                 widths: Sequence[int] = (32, 64, 128, 256)) -> None:
        super().__init__()
        _check_positive("in_channels, n_classes, image_size", (in_channels, n_classes, image_size))
        _check_positive("widths", widths)
        self.stem = nn.Sequential(_conv3x3(in_channels, widths[0]), nn.BatchNorm2d(widths[0]), nn.ReLU())
        blocks, channels = [], widths[0]
        for i, width in enumerate(widths):
            blocks.append(BasicBlock(channels, width, stride=1 if i == 0 else 2))
            channels = width
        self.blocks = nn.Sequential(*blocks)
        self.classifier = nn.Linear(channels, n_classes, bias=False)
        self.input_shape = (in_channels, image_size, image_size)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.blocks(self.stem(x))
        return self.classifier(out.mean(dim=(2, 3)))


def init_weights(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """Conv/linear weights ~ N(0, 0.01²) (the released code's choice); BN keeps γ = 1, β = 0."""
    for module in model.modules():
        if isinstance(module, nn.Conv2d | nn.Linear):
            nn.init.normal_(module.weight, 0.0, INIT_STD, generator=generator)


def binarized_names(model: nn.Module) -> list[str]:
    """Names of the tensors FedBAT binarizes: every conv and linear weight, in registration order."""
    return [f"{name}.weight" for name, module in model.named_modules()
            if isinstance(module, nn.Conv2d | nn.Linear)]
