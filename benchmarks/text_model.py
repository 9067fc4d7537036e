"""A text classifier of the kind users bring, from a package rather than from this repository: Hugging Face
transformers' `GPT2ForSequenceClassification` with GPT-2's vocabulary of 50,257 tokens, 2 layers of width
256 (4 heads), sequences of 32 tokens, 10 classes. Its word embedding (51.5 MB of float32) is nine tenths
of the model's 58 MB: on 2 data servers it is split between them, so a loop on their machine joins it from
two pieces every step. It is the model for the case of a cut inside a large tensor
(`compute/bucket_pull.py`: the whole tensor kept from step to step). What its step costs, and how much of
it is the embedding's dense gradient: docs/benchmarks.md, "Models and data from outside this repository".

    python -m benchmarks.text_model tokens.npz [--samples 2048]   # the synthetic token data
    python -m benchmarks.user_model --model benchmarks.text_model:gpt2_classifier \\
        --dataset tokens.npz --batch 16 --epochs 1

transformers is the `bench` extra, imported when the model is built.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .parts import Logits, write_once

VOCAB = 50_257  # GPT-2's
SEQUENCE = 32
CLASSES = 10


def gpt2_classifier() -> nn.Module:
    """GPT-2's vocabulary, 2 layers of 256: 14.5 M parameters, 58 MB, 51.5 MB of them the word embedding."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    # (A padding token, which the classifier needs for batches of more than one: the last one, which the
    # synthetic data never draws, so every sequence is read to its end.)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=256, n_layer=2, n_head=4, n_positions=SEQUENCE, pad_token_id=VOCAB - 1
    )  # fmt: skip
    # (Set after: its annotated __init__ does not list the keyword, which every config takes.)
    config.num_labels = CLASSES
    torch.manual_seed(0)
    return Logits(GPT2ForSequenceClassification(config), takes="input_ids")


def synthetic_tokens(samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`samples` sequences of token ids (int64, (N, 32)) and labels (int64, 10 classes), learnable: each
    class draws half of its tokens from 64 words of its own, the rest from the whole vocabulary."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, VOCAB - 1, size=(CLASSES, 64))
    y = rng.integers(0, CLASSES, size=samples).astype(np.int64)
    x = rng.integers(0, VOCAB - 1, size=(samples, SEQUENCE))
    own = rng.random((samples, SEQUENCE)) < 0.5
    picks = words[y[:, None], rng.integers(0, 64, size=(samples, SEQUENCE))]
    return np.where(own, picks, x).astype(np.int64), y


def write_tokens(path: str | Path, samples: int) -> str:
    """Write `samples` synthetic sequences (arrays `x`, `y`) to `path` unless it exists; its path."""
    return write_once(path, lambda: synthetic_tokens(samples))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.text_model", description=__doc__.split("\n")[0]
    )
    parser.add_argument("path", type=Path, help="the .npz to write (arrays x and y)")
    parser.add_argument("--samples", type=int, default=2048)
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error(f"--samples {args.samples}: give 1 or more")
    args.path.unlink(missing_ok=True)
    write_tokens(args.path, args.samples)
    print(f"{args.path}: {args.samples} sequences of {SEQUENCE} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
