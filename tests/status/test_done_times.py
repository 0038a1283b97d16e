"""A real worker's done markers carry their completion time and duration in the listing, so status
draws the completion curve and the median task without reading a marker."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from objectstore import open_store
from taskqueue import layout
from tests.queue.conftest import submit_tasks
from tests.workers import Workers


def test_done_markers_list_completed_at_and_seconds(tmp_path: Path):
    url = str(tmp_path / "queue")
    submit_tasks(url, [{"id": f"t{k}", "sleep": 0.3} for k in range(3)])
    (tmp_path / "logs").mkdir()
    workers = Workers(url, tmp_path / "logs")
    before = dt.datetime.now(dt.timezone.utc)
    workers.start("w0", "--idle-timeout", "1")
    workers.wait(timeout=60)
    store = open_store(url)
    entries = list(store.list(layout.DONE))
    assert len(entries) == 3
    for entry in entries:
        body = json.loads(store.read(entry.name).data)
        assert entry.metadata["completed_at"] == body["completed_at"]
        assert dt.datetime.fromisoformat(entry.metadata["completed_at"]) >= before.replace(microsecond=0)
        assert float(entry.metadata["seconds"]) == body["seconds"] >= 0.3
