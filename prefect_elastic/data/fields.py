"""Which fields of a batch the model takes and which the loss takes (`StepFields`), and the one call of the
model and its loss on a batch that both loops make (`StepFields.loss_of`).

A batch is named fields (`Batch`): an `.npz` dataset's `x` and `y`, a Parquet file's or a `datasets`
folder's columns, a factory Dataset's dict keys, or the positions `"0"`, `"1"`, ... of its tuple items.
`inputs` is one field (passed positionally, as `x` is) or a list of fields (passed as keyword arguments, as
Hugging Face models take `input_ids` and `attention_mask`); `target` is the field the loss takes. With
`loss="model"` the model computes its own loss: the target goes to it as the keyword argument `labels`
beside the inputs, and the loss is read from `output.loss`, `output["loss"]` or `output[0]`.

`resolve_fields` decides them once, from the job's settings and the source's fields, before any cluster
work; each refusal names the setting and the fields there are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import JobConfigError

__all__ = ["MODEL_LOSS", "XY_FIELDS", "Batch", "StepFields", "resolve_fields"]

Batch = dict[str, torch.Tensor]  # one micro-batch's fields by name
MODEL_LOSS = "model"  # the `loss` that says the model computes its own


@dataclass(frozen=True)
class StepFields:
    """The fields a step reads from its batch, and how they reach the model and the loss."""

    inputs: tuple[str, ...]
    keyword: bool  # the inputs go as keyword arguments (a list was given), else the one positionally
    target: str | None  # None: the model computes its loss from its inputs alone (`loss="model"`)
    model_loss: bool

    @property
    def used(self) -> tuple[str, ...]:
        """Every field a step reads, each once."""
        return tuple(dict.fromkeys((*self.inputs, *((self.target,) if self.target else ()))))

    def output_of(
        self, forward: Callable[..., Any], batch: Mapping[str, torch.Tensor], device: torch.device
    ) -> tuple[Any, torch.Tensor | None]:
        """The model called on the batch's inputs (with `labels` where it computes its own loss): its
        output (a model output's `logits` unless it computes its loss) and the target on `device`."""
        if self.keyword:
            args: tuple[Any, ...] = ()
            kwargs = {name: batch[name].to(device) for name in self.inputs}
        else:
            args, kwargs = (batch[self.inputs[0]].to(device),), {}
        target = batch[self.target].to(device) if self.target is not None else None
        if self.model_loss:
            if target is not None:
                kwargs["labels"] = target
            return forward(*args, **kwargs), target
        return _prediction(forward(*args, **kwargs)), target

    def loss_of(
        self,
        forward: Callable[..., Any],
        batch: Mapping[str, torch.Tensor],
        device: torch.device,
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None,
    ) -> torch.Tensor:
        """The loss of one micro-batch: the model called on its inputs, and the job's loss (or its own)."""
        output, target = self.output_of(forward, batch, device)
        if self.model_loss:
            return _model_loss(output)
        assert loss_fn is not None and target is not None  # (`resolve_fields` gives both without model loss)
        return loss_fn(output, target)


# An `.npz` dataset's: `x` to the model, `y` to the loss.
XY_FIELDS = StepFields(("x",), False, "y", False)


def _model_loss(output: Any) -> torch.Tensor:
    """The loss a model returned: `output.loss` (a Hugging Face ModelOutput), `output["loss"]`, or
    `output[0]`."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None and isinstance(output, (tuple, list)) and output:
        loss = output[0]
    if loss is None and isinstance(output, torch.Tensor):
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            "with loss='model' the model must return its loss (as output.loss, output['loss'] or output[0]), "
            f"but it returned {type(output).__name__} without one; pass the target field to it as `labels` "
            "(target=...), or give a loss such as 'cross_entropy'"
        )
    return loss


def _prediction(output: Any) -> Any:
    """What the job's loss takes from the model's output: the tensor itself, or a model output's `logits`
    (a Hugging Face model returns a ModelOutput even without labels)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    return output if logits is None else logits


def resolve_fields(
    names: Sequence[str],
    tuple_items: bool,
    inputs: str | Sequence[str] | None,
    target: str | None,
    loss: str,
    shown: str,
) -> StepFields:
    """The step's fields from the job's `inputs`, `target` and `loss` and the source's field `names`
    (`tuple_items`: the items are tuples, their fields named by position). `shown` names the dataset."""
    have = ", ".join(repr(n) for n in names) or "none"
    model_loss = loss == MODEL_LOSS
    if inputs is None:
        if "x" in names:
            chosen: tuple[str, ...] = ("x",)
        elif tuple_items and names:
            chosen = (names[0],)
        else:
            raise JobConfigError(
                "inputs",
                None,
                f"the items of {shown} have the fields {have} and none is 'x'; name the field the model "
                "takes (inputs='pixel_values': passed positionally) or a list of them (inputs=['input_ids', "
                "'attention_mask']: passed as keyword arguments)",
            )
        keyword = False
    elif isinstance(inputs, str):
        chosen, keyword = (inputs,), False
    else:
        chosen, keyword = tuple(inputs), True
        if not chosen:
            raise JobConfigError("inputs", list(inputs), "names no field; give at least one field of " + have)
    for name in chosen:
        if name not in names:
            raise JobConfigError(
                "inputs",
                inputs,
                f"names the field {name!r}, which the items of {shown} lack (they have {have})",
            )
    if target is None:
        if "y" in names:
            target = "y"
        elif tuple_items and len(names) >= 2:
            target = names[1]
        elif model_loss:
            target = "labels" if "labels" in names and "labels" not in chosen else None
        else:
            raise JobConfigError(
                "target",
                None,
                f"the items of {shown} have the fields {have} and none is 'y'; name the field the loss takes "
                "(target='label'), or let the model compute its own loss (loss='model')",
            )
    elif target not in names:
        raise JobConfigError(
            "target", target, f"names a field that the items of {shown} lack (they have {have})"
        )
    return StepFields(chosen, keyword, target, model_loss)
