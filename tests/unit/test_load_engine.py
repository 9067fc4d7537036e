"""What a worker's first task for a job leaves behind (`cluster.workers.load_engine`), run in this process."""

from __future__ import annotations

import gc
import sys

from prefect_elastic.cluster import load_engine


def test_the_engine_is_imported_and_what_it_made_is_frozen_before_the_worker_is_a_member() -> None:
    before = gc.get_freeze_count()
    load_engine(("json", "prefect_elastic.cluster.plugins"))
    assert {"json", "prefect_elastic.cluster.plugins"} <= set(sys.modules)
    # Frozen objects are never scanned again: a member's first full collection no longer silences it.
    assert gc.get_freeze_count() > before
    leftover = len(gc.get_objects())
    assert leftover < gc.get_freeze_count(), "what is left for a collection is what was made since"
