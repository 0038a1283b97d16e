"""Progress records may carry integer `counters`; the done marker's metadata holds their sum, and status adds
them up from the `done/` listing alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from objectstore import open_store
from taskqueue import layout
from taskqueue.lease import sum_counters, sum_metadata_counters
from tests.queue.conftest import submit_tasks
from tests.workers import REPO

#: Writes two records per task: their counters come from the manifest; one malformed entry is ignored.
COUNTING_CONSUMER = textwrap.dedent(
    """
    import json, os
    manifest = json.load(open(os.environ["SPAWN_TASK_FILE"]))
    with open(os.environ["SPAWN_PROGRESS_FILE"], "a") as progress:
        for k, counters in enumerate(manifest["counters"]):
            progress.write(json.dumps({"output": f"part-{k}", "counters": counters}) + "\\n")
    """
)


def status(queue_url: str, *flags: str) -> str:
    # PYTHONPATH: a script under tools/ must import this checkout's packages, not an installed copy's.
    result = subprocess.run([sys.executable, "tools/status.py", queue_url, *flags], cwd=REPO, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_counters_are_summed_into_the_done_marker_metadata_and_status_totals(queue_url, workers, tmp_path):
    consumer = tmp_path / "counting_consumer.py"
    consumer.write_text(COUNTING_CONSUMER)
    submit_tasks(queue_url, [
        {"id": "a", "counters": [{"rows_x": 2, "rows_y": 1}, {"rows_x": 5}]},
        {"id": "b", "counters": [{}, {"rows_x": 1, "junk": "seven"}]},
        {"id": "c", "counters": [{}, {}]},
    ])  # fmt: skip
    workers.start("w", consumer=f"python {consumer}")
    assert workers.wait(timeout=120) == {"w": 0}, workers.log("w")

    done = {e.name: e.metadata for e in open_store(queue_url).list(layout.DONE)}
    assert json.loads(done[layout.done_object("a")]["counters"]) == {"rows_x": 7, "rows_y": 1}
    assert json.loads(done[layout.done_object("b")]["counters"]) == {"rows_x": 1}
    assert "counters" not in done[layout.done_object("c")]
    assert "event=bad_counters" in workers.log("w") and "name=junk" in workers.log("w")

    # A drained queue is swept: status counts its regions from the swept markers alone, so the
    # markers carry the done markers' counters.
    swept = [e.metadata for e in open_store(queue_url).list(layout.SWEPT)]
    assert swept and sum_metadata_counters(m["counters"] for m in swept if "counters" in m) == {"rows_x": 8, "rows_y": 1}
    view = json.loads(status(queue_url, "--json"))
    assert view["regions"]["open"] == 0 and view["counters"] == {"rows_x": 8, "rows_y": 1}
    assert "counted rows_x=8, rows_y=1" in status(queue_url)


def test_sum_counters_ignores_what_is_not_an_integer():
    records = [{"counters": {"n": 1}}, {"counters": [1, 2]}, {"counters": {"n": True, "m": 2.5}}, {"counters": {"n": 3}}]
    assert sum_counters(records) == {"n": 4}
