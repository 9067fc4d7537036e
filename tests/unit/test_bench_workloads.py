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


def test_the_text_classifiers_data_is_token_ids_of_its_vocabulary_that_its_classes_tell_apart(
    tmp_path: Path,
) -> None:
    from benchmarks.text_model import CLASSES, SEQUENCE, VOCAB

    gpt2 = WORKLOADS["gpt2"]
    assert gpt2.tokens and (gpt2.shape, gpt2.batch) == ((SEQUENCE,), 16)
    path = gpt2.dataset(tmp_path, 400)
    assert Path(path).name == "synthetic-tokens-400.npz" and gpt2.dataset(tmp_path, 400) == path
    x, y = load_dataset(path)
    assert tuple(x.shape) == (400, SEQUENCE) and str(x.dtype) == "torch.int64"
    # Never the padding token (the last), which would end a sequence early for the classifier.
    assert int(x.min()) >= 0 and int(x.max()) < VOCAB - 1
    assert set(y.tolist()) == set(range(CLASSES))
    # Learnable: two sequences of a class share tokens (each draws half of its 32 from its class's 64 words),
    # two of different classes next to none (from 50,257; the data is made from a fixed seed).
    same = [len(set(x[i].tolist()) & set(x[j].tolist())) for i, j in _pairs(y, equal=True)]
    other = [len(set(x[i].tolist()) & set(x[j].tolist())) for i, j in _pairs(y, equal=False)]
    assert np.mean(same) > 1.0 and np.mean(other) < 0.2, (same, other)


def _pairs(y: object, equal: bool, n: int = 50) -> list[tuple[int, int]]:
    labels = list(y.tolist())  # type: ignore[attr-defined]
    found = [
        (i, j)
        for i in range(len(labels))
        for j in range(i + 1, len(labels))
        if (labels[i] == labels[j]) == equal
    ]
    return found[:n]
