"""A tiny Hugging Face text classifier, built from a config (no pretrained weights, no download), and the
collate that pads its token lists.

The job passes `input_ids` and `attention_mask` to the model as keywords and, with `loss: model`, the
`label` field as `labels`: `BertForSequenceClassification` computes its own cross entropy (`output.loss`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from make_data import VOCAB
from torch import nn


def make_model() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
        pad_token_id=0,
    )
    return BertForSequenceClassification(config)


def pad_batch(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Token lists padded with id 0 (and mask 0) to the longest of the batch; labels as int64."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.int64)
    mask = torch.zeros(len(samples), longest, dtype=torch.int64)
    for i, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[i, :n] = torch.as_tensor(np.asarray(sample["input_ids"]), dtype=torch.int64)
        mask[i, :n] = torch.as_tensor(np.asarray(sample["attention_mask"]), dtype=torch.int64)
    labels = torch.as_tensor(np.asarray([s["label"] for s in samples]), dtype=torch.int64)
    return {"input_ids": ids, "attention_mask": mask, "label": labels}
