"""The benchmarks' synthetic data and the shape and batch each workload carries (no model is built here: the
resnet18 needs the bench extra, which the test suite does not)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from benchmarks.workloads import MNIST_SHAPE, WORKLOADS, load_dataset, synthetic_images


def test_the_mnist_shaped_data_is_the_same_as_before_a_workload_had_a_shape() -> None:
    # The digest of synthetic_images(64, seed=3) when every workload read 1x28x28: the figures measured on
    # the data before and after stay comparable.
    x, y = synthetic_images(64, seed=3)
    digest = hashlib.sha256(x.tobytes() + y.tobytes()).hexdigest()
    assert digest == "a80208f8da844d9c8babc73a3fd4cd07ef9b9edcd0baf52488c3eecec00cb094"


def test_cifar_shaped_data_has_the_shape_and_ten_classes() -> None:
    x, y = synthetic_images(300, shape=(3, 32, 32))
    assert x.shape == (300, 3, 32, 32) and x.dtype == np.float32
    assert y.dtype == np.int64 and set(y.tolist()) == set(range(10))


def test_the_existing_workloads_keep_their_shape_and_batch_and_the_resnet_has_its_own() -> None:
    for name in ("cnn", "cnn-20", "transformer", "mlp", "cnn-gpu"):
        assert (WORKLOADS[name].shape, WORKLOADS[name].batch) == (MNIST_SHAPE, 128)
    assert (WORKLOADS["resnet18"].shape, WORKLOADS["resnet18"].batch) == ((3, 32, 32), 32)


def test_a_workloads_dataset_is_written_once_per_shape(tmp_path: Path) -> None:
    mnist = WORKLOADS["mlp"].dataset(tmp_path, 40)
    assert Path(mnist).name == "synthetic-40.npz"  # the name the MNIST-shaped data always had
    assert WORKLOADS["cnn-20"].dataset(tmp_path, 40) == mnist
    cifar = WORKLOADS["resnet18"].dataset(tmp_path, 40)
    assert Path(cifar).name == "synthetic-3x32x32-40.npz"
    x, y = load_dataset(cifar)
    assert tuple(x.shape) == (40, 3, 32, 32) and tuple(y.shape) == (40,)
    assert tuple(load_dataset(mnist)[0].shape) == (40, 1, 28, 28)
