"""The step's fields (`data/fields.py`): which fields the model and the loss take by default and by setting,
each refusal naming the setting and the fields there are; the model called positionally or by keywords,
with its own loss; and the schedule's samples (`Schedule.samples`, the shuffle by blocks)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from prefect_elastic.data.batches import named_batch
from prefect_elastic.data.fields import XY_FIELDS, StepFields, resolve_fields
from prefect_elastic.data.seeding import sample_seed, seeded_sample
from prefect_elastic.errors import JobConfigError
from prefect_elastic.schedule import Schedule

CPU = torch.device("cpu")


def test_the_defaults_are_x_and_y_or_a_tuples_first_and_second() -> None:
    assert resolve_fields(("x", "y"), False, None, None, "cross_entropy", "d") == XY_FIELDS
    fields = resolve_fields(("0", "1", "2"), True, None, None, "cross_entropy", "d")
    assert (fields.inputs, fields.keyword, fields.target) == (("0",), False, "1")


def test_a_list_of_inputs_goes_as_keywords_and_a_name_positionally() -> None:
    names = ("input_ids", "attention_mask", "label")
    listed = resolve_fields(names, False, ["input_ids", "attention_mask"], "label", "cross_entropy", "d")
    assert listed.keyword and listed.inputs == ("input_ids", "attention_mask")
    assert listed.used == ("input_ids", "attention_mask", "label")
    one = resolve_fields(names, False, "input_ids", "label", "cross_entropy", "d")
    assert not one.keyword


@pytest.mark.parametrize(
    ("inputs", "target", "setting", "named"),
    [
        (None, "label", "inputs", "'input_ids'"),  # no 'x': the message lists the fields there are
        ("pixels", "label", "inputs", "'pixels'"),
        (["input_ids", "mask"], "label", "inputs", "'mask'"),
        ("input_ids", None, "target", "'label'"),
        ("input_ids", "labels", "target", "'label'"),
    ],
)
def test_a_missing_field_is_refused_naming_the_setting_and_the_fields(
    inputs: object, target: str | None, setting: str, named: str
) -> None:
    with pytest.raises(JobConfigError) as caught:
        resolve_fields(("input_ids", "label"), False, inputs, target, "cross_entropy", "dataset d")  # type: ignore[arg-type]
    assert caught.value.field == setting
    assert named in str(caught.value)


def test_the_models_own_loss_takes_the_target_as_labels() -> None:
    fields = resolve_fields(("input_ids", "label"), False, ["input_ids"], "label", "model", "d")
    seen: dict[str, torch.Tensor] = {}

    def forward(**kwargs: torch.Tensor) -> SimpleNamespace:
        seen.update(kwargs)
        return SimpleNamespace(loss=kwargs["input_ids"].float().sum(), logits=None)

    batch = {"input_ids": torch.tensor([[1, 2]]), "label": torch.tensor([1])}
    loss = fields.loss_of(forward, batch, CPU, None)
    assert float(loss) == 3.0 and set(seen) == {"input_ids", "labels"}
    # Without a target (a causal LM with its labels among the inputs) nothing is added.
    alone = resolve_fields(("input_ids", "labels"), False, ["input_ids", "labels"], None, "model", "d")
    assert alone.target is None


def test_a_model_output_gives_its_logits_to_the_jobs_loss() -> None:
    fields = StepFields(("x",), False, "y", False)
    logits = torch.tensor([[0.0, 5.0]])
    out = fields.loss_of(lambda x: {"logits": logits}, {"x": torch.zeros(1), "y": torch.tensor([1])}, CPU,
                         torch.nn.functional.cross_entropy)  # fmt: skip
    assert float(out) == pytest.approx(float(torch.nn.functional.cross_entropy(logits, torch.tensor([1]))))
    with pytest.raises(TypeError, match="must return its loss"):
        StepFields(("x",), False, None, True).loss_of(lambda x: "nothing", {"x": torch.zeros(1)}, CPU, None)


def test_a_collated_batch_is_named_by_key_or_position() -> None:
    assert set(named_batch({"a": torch.ones(2), "b": [1, 2]}, ("a", "b"))) == {"a", "b"}
    by_position = named_batch((torch.ones(2), torch.zeros(2)), ("0", "1"))
    assert torch.equal(by_position["1"], torch.zeros(2))
    with pytest.raises(KeyError, match="'label'"):
        named_batch({"a": torch.ones(2)}, ("label",))


def test_a_samples_draws_are_seeded_by_the_sample_and_put_back() -> None:
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    before = (torch.rand(1), np.random.rand(), random.random())
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    with seeded_sample(sample_seed(0, 1, 42)):
        first = (torch.rand(1), np.random.rand(), random.random())
    after = (torch.rand(1), np.random.rand(), random.random())
    assert torch.equal(after[0], before[0]) and after[1:] == before[1:]  # the stream goes on untouched
    with seeded_sample(sample_seed(0, 1, 42)):
        again = (torch.rand(1), np.random.rand(), random.random())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]
    assert len({sample_seed(0, e, i) for e in range(3) for i in range(100)}) == 300


def test_the_full_shuffle_is_todays_and_the_samples_are_global() -> None:
    schedule = Schedule((100, 103), 8, 2, 2, 0)
    assert (
        schedule.sample_indices(0).tolist() == np.random.default_rng([0, 0, 0]).permutation(100)[:8].tolist()
    )
    epoch, samples = schedule.samples(1)  # (batch 1 lives on data server 1, whose samples start at 100)
    assert epoch == 0 and samples.tolist() == (schedule.sample_indices(1) + 100).tolist()
    assert schedule.server_batches_after(1, 3) == [3, 5, 7]


@pytest.mark.parametrize("window", [1, 2, 5])
def test_a_shuffle_by_blocks_reads_each_sample_once_from_few_blocks(window: int) -> None:
    schedule = Schedule((100, 103), 8, 2, 2, 0, block_rows=16, window_blocks=window)
    for epoch in range(2):
        for server in range(2):
            seen: list[int] = []
            for b in range(epoch * schedule.batches_per_epoch, (epoch + 1) * schedule.batches_per_epoch):
                if schedule.server_of(b) != server:
                    continue
                _, samples = schedule.samples(b)
                seen += samples.tolist()
                # Blocks at multiples of 16 of the global index: a batch spans two runs of them at most.
                assert len({int(i) // 16 for i in samples}) <= 2 * window
            assert len(seen) == len(set(seen))  # every sample at most once an epoch
    assert not np.array_equal(schedule.samples(0)[1], schedule.samples(schedule.batches_per_epoch)[1])
