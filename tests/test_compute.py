"""The compute worker's gradient of one micro-batch, without a cluster."""

from __future__ import annotations

import torch

from prefect_elastic import ElasticJob
from prefect_elastic.compute import MicroBatchTrainer, micro_batch_seed


def test_gradient_equals_an_ordinary_model_with_tied_weights_and_dropout(digits_url: str) -> None:
    job = ElasticJob(model="tests.models:tied_dropout", dataset=digits_url, data_servers=4, seed=3)
    layout, tensors = job.initial_tensors()
    trainer = MicroBatchTrainer(job, [list(tensors)], layout, torch.device("cpu"))
    params = {n: tensors[n].clone().requires_grad_(True) for n in trainer.param_names}
    buffers = {n: t for n, t in tensors.items() if n not in params}
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 10, (16,))

    loss, grads, _ = trainer.gradient(params, buffers, x, y, step=0, batch_id=5)
    again, _, _ = trainer.gradient(params, buffers, x, y, step=0, batch_id=5)
    other, _, _ = trainer.gradient(params, buffers, x, y, step=0, batch_id=6)
    assert loss == again, "the same batch id draws the same dropout mask"
    assert loss != other, "another batch id draws another"

    ordinary = job.initial_model()
    torch.manual_seed(micro_batch_seed(job.seed, 5))
    torch.nn.functional.cross_entropy(ordinary(x), y).backward()
    for name, p in ordinary.named_parameters():  # the tied weight appears once, with both uses summed
        assert torch.equal(grads[name], p.grad), name
    assert set(grads) == set(layout.params)
