"""The Prefect server fixture: one real `prefect server start` (SQLite, UI on) for the test session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from prefect_elastic.local.prefect_server import PrefectServer, free_port

__all__ = ["PrefectServer", "free_port", "prefect_server"]


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    with PrefectServer(tmp_path_factory.mktemp("prefect-home")) as server:
        yield server
