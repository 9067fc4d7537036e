"""The workloads every system is measured on, fixed here so that all of them train the same thing. What a
step of each takes on this machine is in docs/benchmarks.md (its list of workloads, at the top).

- `cnn`: compute-bound; a small CNN on 28x28 images (three 3x3 convolutions of 32, 64 and 64 channels,
  global average pooling, a linear layer; 56,394 parameters, 226 KB), batch 128: nearly all of a step is
  convolution.
- `cnn-20`: the same network narrower (8, 16 and 32 channels; 6,218 parameters, 25 KB), batch 128: a
  fifth of the cnn's step, the step of a model a user brings to a GPU (5 to 30 ms), where the framework's
  fixed cost per step decides the throughput.
- `transformer`: a model built from torch's own modules rather than this repository's layers (one
  `nn.TransformerEncoderLayer`, d_model 32, 2 heads, feed-forward 64, dropout 0.1), reading each image as
  28 tokens of 28 pixels, then mean pooling and a linear layer (9,802 parameters), batch 128: a light step,
  as cnn-20's; dropout draws random numbers every step.
- `mlp`: communication-bound; 784-512-512-10 (669,706 parameters, 2.68 MB of float32), batch 128 (a
  step moves the parameters and their gradient, and computes little).
- `resnet18`: a model of the size people train, from a package a user takes it from rather than from this
  repository: Hugging Face transformers' `ResNetForImageClassification` in the ResNet-18 shape (11,181,642
  parameters, 44.7 MB, BatchNorm), on CIFAR-shaped images (3x32x32), batch 32. transformers is the `bench`
  extra (`pip install -e ".[bench]"`): imported only when the model is built.
- `gpt2`: a text classifier from the same package (`benchmarks/text_model.py`: transformers'
  `GPT2ForSequenceClassification` with GPT-2's vocabulary, 2 layers of 256; 58 MB, 51.5 MB of it the word
  embedding, whose gradient backward makes last), on sequences of 32 synthetic token ids, batch 16.

The data is synthetic, MNIST-shaped (1x28x28 float32, 10 classes) unless a workload says otherwise (its
`shape`), made from a seed, so every system reads the very same samples without a download. It is learnable:
each class is a fixed random pattern, each sample that pattern scaled and buried in noise (twice the
pattern's spread), so the loss keeps falling for several epochs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .parts import Logits, write_once

BATCH = 128  # samples per optimizer step (one micro-batch of 128, or micro-batches summing to it)
MNIST_SHAPE = (1, 28, 28)  # one sample of the synthetic data, unless a workload says otherwise
LR = 0.02  # 0.05 with momentum 0.9 diverged for a while on the cnn in one of the systems' data orders
MOMENTUM = 0.9
THREADS = 1  # torch threads of every training process, in every system


def conv3(channels: tuple[int, int, int]) -> nn.Module:
    """Three 3x3 convolutions (two max-pools between them), global average pooling, a linear layer."""
    c1, c2, c3 = channels
    return nn.Sequential(
        nn.Conv2d(1, c1, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c2, c3, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c3, 10),
    )


def cnn() -> nn.Module:
    return conv3((32, 64, 64))


# Chosen by timing the plain loop (one thread, batch 128) at several widths in fresh processes, on an idle
# machine, beside the cnn: the width whose step is about a fifth of the cnn's (the timings of each width:
# docs/benchmarks.md, its list of workloads).
CNN20_CHANNELS = (8, 16, 32)


def cnn20() -> nn.Module:
    return conv3(CNN20_CHANNELS)


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def cnn_gpu() -> nn.Module:
    """A CNN sized for a GPU step of a few milliseconds: three 3x3 convolutions of 128, 256 and 256
    channels, all at the full 28x28 (no pooling between them), then global average pooling and a linear
    layer (888,330 parameters, 3.6 MB). About 0.5 TFLOP a step of 128: too slow for this machine's CPUs
    (seconds a step), measured on a GPU only (`benchmarks/gpu.py`)."""
    return nn.Sequential(
        nn.Conv2d(1, 128, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(128, 256, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(256, 256, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(256, 10),
    )


class RowTransformer(nn.Module):
    """Each 28x28 image as a sequence of 28 rows of 28 pixels, through one transformer encoder layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(28, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(x.shape[0], 28, 28)
        return self.head(self.encoder(self.embed(rows)).mean(dim=1))


def transformer() -> nn.Module:
    return RowTransformer()


def resnet18() -> nn.Module:
    """ResNet-18 (basic blocks, 2-2-2-2, 64 to 512 channels) for 10 classes, as transformers builds it."""
    # (Imported here: transformers is an optional extra, and takes seconds to import.)
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        num_channels=3, embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
        layer_type="basic",
    )  # fmt: skip
    # (Set after: its annotated __init__ does not list the keyword, which every config takes.)
    config.num_labels = 10
    return Logits(ResNetForImageClassification(config))


@dataclass(frozen=True)
class Workload:
    name: str
    model: str  # import path, as an ElasticJob names it
    kind: str  # compute-bound | communication-bound
    shape: tuple[int, ...] = MNIST_SHAPE  # one sample of its data
    batch: int = BATCH  # samples per step of one worker (the plain loop's step)
    tokens: bool = False  # its samples are token ids (`text_model.synthetic_tokens`), not images

    def make(self) -> nn.Module:
        torch.manual_seed(0)
        makers = {
            "cnn": cnn, "cnn-20": cnn20, "transformer": transformer, "mlp": mlp, "cnn-gpu": cnn_gpu,
            "resnet18": resnet18, "mlp-50": mlp50, "gpt2": gpt2,
        }  # fmt: skip
        return makers[self.name]()

    def dataset(self, folder: str | Path, samples: int) -> str:
        """The synthetic dataset of this workload's shape in `folder` (written the first time), its path.
        Workloads of one shape share one file; the MNIST-shaped one keeps the name it always had."""
        if self.tokens:
            from .text_model import write_tokens

            return write_tokens(Path(folder) / f"synthetic-tokens-{samples}.npz", samples)
        shape = "" if self.shape == MNIST_SHAPE else "x".join(map(str, self.shape)) + "-"
        return write_dataset(Path(folder) / f"synthetic-{shape}{samples}.npz", samples, shape=self.shape)

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.make().parameters())


def gpt2() -> nn.Module:
    from .text_model import gpt2_classifier

    return gpt2_classifier()


def wide_mlp() -> nn.Module:
    """784-5000-5000-10: the 5000x5000 weight (100 MB of float32) and its SGD momentum make one data
    server's shard of 200 MB (`benchmarks/standby.py: shard_restore`); never trained here."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 5000), nn.ReLU(), nn.Linear(5000, 5000), nn.ReLU(), nn.Linear(5000, 10)
    )


def mlp50() -> nn.Module:
    """784-3200-3200-10: an MLP of 51 MB of parameters, where moving the bytes is most of a step's cost."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 3200), nn.ReLU(), nn.Linear(3200, 3200), nn.ReLU(), nn.Linear(3200, 10)
    )


def wide_mlp_smoke() -> nn.Module:
    """784-1000-1000-10: `wide_mlp`'s shape with a shard of 8 MB, for the smoke run (`--smoke`)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 1000), nn.ReLU(), nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 10)
    )


WORKLOADS = {
    "cnn": Workload("cnn", "benchmarks.workloads:cnn", "compute-bound"),
    "cnn-20": Workload("cnn-20", "benchmarks.workloads:cnn20", "light compute, a fifth of the cnn"),
    "transformer": Workload(
        "transformer", "benchmarks.workloads:transformer", "torch's TransformerEncoder, light compute"
    ),
    "mlp": Workload("mlp", "benchmarks.workloads:mlp", "communication-bound"),
    "mlp-50": Workload("mlp-50", "benchmarks.workloads:mlp50", "an MLP of 51 MB, communication-bound"),
    "cnn-gpu": Workload("cnn-gpu", "benchmarks.workloads:cnn_gpu", "compute-bound on a GPU (GPU runs only)"),
    "resnet18": Workload(
        "resnet18",
        "benchmarks.workloads:resnet18",
        "transformers' ResNet-18, 45 MB (the bench extra)",
        shape=(3, 32, 32),
        batch=32,
    ),
    "gpt2": Workload(
        "gpt2",
        "benchmarks.workloads:gpt2",
        "transformers' GPT-2 classifier, 58 MB, 51.5 MB of it the embedding (the bench extra)",
        shape=(32,),  # (token ids: `text_model.SEQUENCE`)
        batch=16,
        tokens=True,
    ),
}


def synthetic_images(
    samples: int, seed: int = 0, shape: tuple[int, ...] = MNIST_SHAPE
) -> tuple[np.ndarray, np.ndarray]:
    """`samples` images of `shape` (float32, (N, *shape)) and labels (int64, 10 classes)."""
    rng = np.random.default_rng(seed)
    prototypes = rng.normal(0.0, 1.0, size=(10, *shape)).astype(np.float32)
    y = rng.integers(0, 10, size=samples).astype(np.int64)
    scale = rng.uniform(0.5, 1.5, size=(samples, *(1 for _ in shape))).astype(np.float32)
    x = prototypes[y] * scale + rng.normal(0.0, 2.0, size=(samples, *shape)).astype(np.float32)
    return x, y


def write_dataset(path: str | Path, samples: int, seed: int = 0, shape: tuple[int, ...] = MNIST_SHAPE) -> str:
    """Write the synthetic dataset (samples of `shape`) as one .npz (arrays `x`, `y`) and return its path.
    An existing file is kept: the path names the data (callers put the shape and the size in it)."""
    return write_once(path, lambda: synthetic_images(samples, seed, shape))


def load_dataset(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    with np.load(path) as data:
        return torch.from_numpy(data["x"]), torch.from_numpy(data["y"])
