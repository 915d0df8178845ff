"""Image data: synthetic class patterns, and torchvision's MNIST and FashionMNIST."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset, TensorDataset

from fsdp_exp.data import GeneratedData, TrainData
from fsdp_exp.errors import ConfigError, at_least, choice


@dataclass
class SyntheticImages(GeneratedData):
    """A fixed random pattern per class plus noise; the same for every seed-sharing rank."""

    num_samples: int = 10000
    image_size: int = 28
    num_classes: int = 10
    noise: float = 1.0
    seed: int = 0  # fixes the class patterns; the same data for every training seed

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("num_samples", "image_size", "num_classes"):
            at_least(f"data.{key}", getattr(self, key), 1)
        at_least("data.noise", self.noise, 0)

    def dataset(self) -> Dataset:
        g = torch.Generator().manual_seed(self.seed)
        return self._samples(self._patterns(g), self.num_samples, g)

    def eval_dataset(self) -> Dataset:
        """New samples of the same classes: a tenth as many, from another generator."""
        patterns = self._patterns(torch.Generator().manual_seed(self.seed))
        return self._samples(patterns, max(1, self.num_samples // 10), torch.Generator().manual_seed(self.seed + _HELD_OUT))

    def _patterns(self, g: torch.Generator) -> torch.Tensor:
        return torch.randn(self.num_classes, 1, self.image_size, self.image_size, generator=g)

    def _samples(self, patterns: torch.Tensor, count: int, g: torch.Generator) -> Dataset:
        labels = torch.randint(0, self.num_classes, (count,), generator=g)
        images = patterns[labels] + self.noise * torch.randn(count, *patterns.shape[1:], generator=g)
        return TensorDataset(images, labels)


# Offset to the seed of held-out synthetic samples (any value far from the seeds people use).
_HELD_OUT = 1_000_003

# Per-dataset pixel mean and std, from the training sets.
_NORMALIZE = {"MNIST": (0.1307, 0.3081), "FashionMNIST": (0.2860, 0.3530)}
DataSetName = choice("DataSetName", _NORMALIZE, __name__)


@dataclass
class TorchvisionImages(TrainData):
    """torchvision's MNIST or FashionMNIST, read from `<root>/<name>/raw` by torchvision."""

    name: DataSetName = DataSetName["FashionMNIST"]  # MNIST | FashionMNIST
    root: str = "data"  # the IDX files are read from <root>/<name>/raw
    download: bool = False
    num_classes = 10

    def dataset(self, train: bool = True) -> Dataset:
        import torchvision.datasets

        cls = getattr(torchvision.datasets, self.name)
        try:
            source = cls(self.root, train=train, download=self.download)
        except RuntimeError as err:  # torchvision: "Dataset not found. You can use download=True"
            raw = Path(self.root) / self.name / "raw"
            raise ConfigError(
                f"data.root={self.root}: no {self.name} IDX files in {raw} ({err}); "
                "put them there or set data.download=true"
            ) from None
        # The whole set fits in memory as tensors: no per-sample PIL decode in the hot loop.
        mean, std = _NORMALIZE[self.name]
        images = (source.data.unsqueeze(1).float() / 255 - mean) / std
        return TensorDataset(images, source.targets.long())

    def eval_dataset(self) -> Dataset:
        """The test split (t10k files)."""
        return self.dataset(train=False)
