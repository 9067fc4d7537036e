"""A bucket's update, without a cluster: torch's optimizers applied bucket by bucket over views of a
shard's flat parameters give the bits of one update over the whole shard, and SGD written out of place
into the other copy (`sgd_into`) gives the bits of torch's in-place SGD, leaving the published copy as it
was."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from prefect_elastic.data_server.bucket_apply import AdamState, adam_into, sgd_into

# A shard's flat parameters cut into buckets of odd lengths (vectorized kernels treat tails apart, and a
# bucket's tail lies inside the whole tensor's body).
CUTS = (0, 7, 40, 41, 300, 1029)

SGD_SETTINGS: list[dict[str, Any]] = [
    {"lr": 0.02, "momentum_factor": 0.9},
    {"lr": 0.1},
    {"lr": 0.02, "momentum_factor": 0.9, "weight_decay": 1e-4, "nesterov": True},
    {"lr": 0.05, "momentum_factor": 0.5, "dampening": 0.1, "maximize": True},
]


def tensors(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    size = CUTS[-1]
    return (
        torch.randn(size, generator=generator),
        torch.randn(size, generator=generator) * 1e-2,
        torch.randn(size, generator=generator) * 1e-3,
    )


def torch_sgd(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor | None, settings: dict[str, Any]
) -> torch.Tensor | None:
    buffers = [m]
    sgd(
        [p], [g], buffers, weight_decay=settings.get("weight_decay", 0.0),
        momentum=settings.get("momentum_factor", 0.0), lr=settings["lr"],
        dampening=settings.get("dampening", 0.0), nesterov=settings.get("nesterov", False),
        maximize=settings.get("maximize", False), has_sparse_grad=False, foreach=False, fused=False,
    )  # fmt: skip
    return buffers[0]


@pytest.mark.parametrize("settings", SGD_SETTINGS)
def test_sgd_into_the_other_copy_gives_torchs_bits_bucket_by_bucket(settings: dict[str, Any]) -> None:
    params, grad, momentum = tensors(0)
    has_momentum = settings.get("momentum_factor", 0.0) != 0
    # Two steps: the first without a momentum buffer (torch makes one from the gradient), then with it.
    whole_p, whole_m = params.clone(), None
    copies = [
        (params.clone(), torch.zeros_like(params)),
        (torch.zeros_like(params), torch.zeros_like(params)),
    ]
    published = 0
    for step in range(2):
        g = grad * (step + 1)
        whole_m = torch_sgd(whole_p, g, whole_m, settings)
        (src_p, src_m), (dst_p, dst_m) = copies[published], copies[1 - published]
        before = (src_p.clone(), src_m.clone())
        for a, z in itertools.pairwise(CUTS):
            sgd_into(
                src_p[a:z],
                src_m[a:z] if step > 0 and has_momentum else None,
                g[a:z],
                dst_p[a:z],
                dst_m[a:z] if has_momentum else None,
                **settings,
            )
        assert torch.equal(src_p, before[0]) and torch.equal(src_m, before[1])  # the published copy
        published = 1 - published
        assert torch.equal(copies[published][0], whole_p), step
        if has_momentum:
            assert whole_m is not None and torch.equal(copies[published][1], whole_m)
    assert not torch.equal(whole_p, params)  # (it moved: the comparison above means something)
    del momentum


def test_momentum_needs_the_other_copys_buffer() -> None:
    p, g, _ = tensors(1)
    with pytest.raises(ValueError, match="momentum buffer"):
        sgd_into(p, None, g, p.clone(), None, lr=0.1, momentum_factor=0.9)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_bucket_by_bucket_over_views_gives_the_whole_shards_bits(amsgrad: bool) -> None:
    # (Elementwise: the premise of applying a shard's update bucket by bucket, for the optimizers that
    # copy into the other copy and update in place.)
    params, grad, _ = tensors(2)
    whole = params.clone()
    buckets = params.clone()
    state = {k: torch.zeros_like(params) for k in ("m", "v", "vmax")}
    bucket_state = {k: torch.zeros_like(params) for k in ("m", "v", "vmax")}
    for step in range(1, 4):
        g = grad * step
        kwargs: dict[str, Any] = {
            "amsgrad": amsgrad, "beta1": 0.9, "beta2": 0.999, "lr": 1e-3, "weight_decay": 0.0, "eps": 1e-8,
            "maximize": False, "foreach": False,
        }  # fmt: skip
        adam([whole], [g], [state["m"]], [state["v"]], [state["vmax"]], [torch.tensor(float(step))], **kwargs)
        for a, z in itertools.pairwise(CUTS):
            adam(
                [buckets[a:z]], [g[a:z]], [bucket_state["m"][a:z]], [bucket_state["v"][a:z]],
                [bucket_state["vmax"][a:z]], [torch.tensor(float(step))], **kwargs,
            )  # fmt: skip
        assert torch.equal(whole, buckets), step


@pytest.mark.parametrize(
    "settings",
    [
        {"lr": 1e-3},
        {"lr": 1e-3, "weight_decay": 0.01, "amsgrad": True},
        {"lr": 2e-3, "weight_decay": 0.01, "decoupled_weight_decay": True},  # AdamW
        {"lr": 1e-3, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "maximize": True, "amsgrad": True},
    ],
)
def test_adam_into_the_other_copy_gives_torchs_bits_bucket_by_bucket(settings: dict[str, Any]) -> None:
    params, grad, _ = tensors(3)
    amsgrad = settings.get("amsgrad", False)
    whole = params.clone()
    whole_state = [torch.zeros_like(params) for _ in range(3)]
    steps = [torch.tensor(0.0)]

    def copy_of(p: torch.Tensor) -> tuple[torch.Tensor, AdamState]:
        zeros = [torch.zeros_like(params) for _ in range(3)]
        return p, AdamState(zeros[0], zeros[1], zeros[2] if amsgrad else None)

    copies = [copy_of(params.clone()), copy_of(torch.zeros_like(params))]
    published = 0
    for step in range(1, 4):
        g = grad * step
        adam(
            [whole], [g], [whole_state[0]], [whole_state[1]], [whole_state[2]], steps,
            foreach=False, amsgrad=amsgrad, beta1=settings.get("beta1", 0.9),
            beta2=settings.get("beta2", 0.999), lr=settings["lr"],
            weight_decay=settings.get("weight_decay", 0.0), eps=settings.get("eps", 1e-8),
            maximize=settings.get("maximize", False),
            decoupled_weight_decay=settings.get("decoupled_weight_decay", False),
        )  # fmt: skip
        (src, src_state), (dst, dst_state) = copies[published], copies[1 - published]
        before = src.clone()
        for a, z in itertools.pairwise(CUTS):
            adam_into(
                src[a:z],
                AdamState(*(t[a:z] if t is not None else None for t in vars(src_state).values())),
                g[a:z],
                dst[a:z],
                AdamState(*(t[a:z] if t is not None else None for t in vars(dst_state).values())),
                step=step,
                **settings,
            )
        assert torch.equal(src, before)
        published = 1 - published
        new, new_state = copies[published]
        assert torch.equal(new, whole), step
        assert torch.equal(new_state.exp_avg, whole_state[0]) and torch.equal(
            new_state.exp_avg_sq, whole_state[1]
        )
        if amsgrad:
            assert new_state.max_exp_avg_sq is not None and torch.equal(
                new_state.max_exp_avg_sq, whole_state[2]
            )
    assert not torch.equal(whole, params)
