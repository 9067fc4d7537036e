"""The cases a CI run keeps (`conftest.rotated_case`): one of each test's cases that differ only in a policy,
a role or a mode, picked by the seed; the other tests all kept."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..conftest import rotated_case


def item(name: str, case: str | None = None) -> Any:
    node = f"tests/test_x.py::{name}" + (f"[{case}]" if case else "")
    return SimpleNamespace(nodeid=node, callspec=SimpleNamespace(id=case) if case else None)


def test_one_case_of_each_rotated_test_is_kept_and_every_other_test_stays() -> None:
    items = [
        item("test_a", "rollback"), item("test_a", "reassign"),
        item("test_b", "data-server"), item("test_b", "coordinator"),
        item("test_c", "sync-rollback"), item("test_c", "sync-reassign"), item("test_c", "async-reassign"),
        item("test_d", "sqlite-x"), item("test_d", "sqlite-y"), item("test_d", "postgres-x"),
        item("test_e"),
        item("test_h", "no-nanny"), item("test_h", "nanny"),
        item("test_f", "rollback"),  # (its only case: kept)
        item("test_g", "adam-rollback"), item("test_g", "adam-reassign"), item("test_g", "sgd-rollback"),
    ]  # fmt: skip
    kept, left = rotated_case(items)  # type: ignore[arg-type]
    names = [i.nodeid.split("::")[1] for i in kept]
    for test, cases in (
        ("test_a", 1),
        ("test_b", 1),
        ("test_c", 1),
        ("test_d", 2),
        ("test_e", 1),
        ("test_f", 1),
    ):
        assert sum(n.startswith(test) for n in names) == cases, (test, names)
    # The other parameters tell the groups apart: one policy for adam, sgd's only case kept.
    assert sum(n.startswith("test_g[adam") for n in names) == 1 and "test_g[sgd-rollback]" in names
    # The database rotates per other parameter: x has both (one kept), y only sqlite (kept).
    assert sum(n.startswith("test_d") and n.endswith("-x]") for n in names) == 1
    assert "test_d[sqlite-y]" in names
    assert len(kept) + len(left) == len(items)
