"""Dead letters grouped by reason with true counts: the reason is in each letter's listed metadata
(taskqueue.lease.marker_of writes it), so no group is headed by only the MAX_REASONS letters read,
and letters written before that are counted as not read, above the groups."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
from pathlib import Path

from objectstore import open_store
from taskqueue import layout
from taskqueue.lease import DEAD, marker_of
from reporting.status import MAX_REASONS
from taskqueue.submit import submit
from tools import status as status_tool

NOW = dt.datetime(2026, 11, 24, 8, 0, 0, tzinfo=dt.timezone.utc)
BAD_INPUT = "consumer exit 65: bad input"
EXPIRED = "its lease expired 10 times"


def status(url: str, *args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert status_tool.main([url, "--now", NOW.isoformat(), *args]) == 0
    return out.getvalue()


def dead_letter(store, task_id: str, reason: str, listed: bool = True) -> None:
    """The dead letter a holder (or a sweep) writes for the tombstone; `listed` False: an older one, without the metadata."""
    error = {"attempt": 1, "exit_code": 65, "error": f"event=bad_input exit=65 error=row of {task_id} is null"}
    name, body, metadata = marker_of({"task": task_id, "state": DEAD, "reason": reason, "errors": [error], "worker": "w"})
    store.create(name, body, metadata=metadata if listed else None)


def test_groups_count_every_dead_letter_by_its_listed_reason(tmp_path: Path):
    url = str(tmp_path / "queue")
    store = open_store(url)
    submit(store, None, [(f"t{k:03d}", b"{}") for k in range(40)])
    for k in range(25):
        dead_letter(store, f"t{k:03d}", BAD_INPUT)
    for k in range(25, 30):
        dead_letter(store, f"t{k:03d}", EXPIRED)
    [entry] = list(store.list(layout.failed_object("t000")))
    assert entry.metadata == {"reason": BAD_INPUT}
    view = json.loads(status(url, "--json"))
    assert view["failed"] == 30 and len(view["failed_reasons"]) == MAX_REASONS == 20
    assert view["failed_by_reason"] == {BAD_INPUT: 25, EXPIRED: 5}
    text = status(url)
    assert f"failed  x25 {BAD_INPUT} | t000: row of t000 is null" in text
    assert f"failed  x5 {EXPIRED}\n" in text  # none of the 5 among the 20 read: no example line
    assert "not read" not in text
    page = tmp_path / "status.html"
    status(url, "--html", str(page))
    html = page.read_text()
    assert f"<b>{BAD_INPUT}</b>: 25 (the first lines of 20 read)" in html
    assert f"<b>{EXPIRED}</b>: 5</p>" in html


def test_older_dead_letters_without_a_listed_reason_are_counted_as_not_read_above_the_groups(tmp_path: Path):
    url = str(tmp_path / "queue")
    store = open_store(url)
    submit(store, None, [(f"t{k:03d}", b"{}") for k in range(40)])
    for k in range(30):
        dead_letter(store, f"t{k:03d}", BAD_INPUT, listed=False)
    view = json.loads(status(url, "--json"))
    assert (view["failed"], view["failed_by_reason"]) == (30, {})
    text = status(url)
    assert f"failed  x20 {BAD_INPUT} | t000: row of t000 is null" in text
    assert "failed  x10 reason not read" in text
    page = tmp_path / "status.html"
    status(url, "--html", str(page))
    html = page.read_text()
    note, group = html.index("10 of them are older"), html.index(f"<b>{BAD_INPUT}</b>: 20</p>")
    assert note < group


def test_blocked_dead_letters_are_counted_in_full_not_from_the_twenty_read(tmp_path: Path):
    """The defect: 140 dead letters, the view read 20 (MAX_REASONS) and said "... 10 more" (20 held
    less the 10 shown), hiding 120. The count of more is the queue's, in both the capped and the full
    view (45 here: the old view said "... 10 more" of them too)."""
    url = str(tmp_path / "queue")
    store = open_store(url)
    submit(store, None, [(f"t{k:03d}", b"{}") for k in range(50)])
    for k in range(45):
        dead_letter(store, f"t{k:03d}", BAD_INPUT)
    view = json.loads(status(url, "--json"))
    assert view["blockers_total"] == {"batch": 0, "stale_lease": 0, "dead_letter": 45}
    assert len([b for b in view["blockers"] if b["kind"] == "dead_letter"]) == MAX_REASONS
    named = ", ".join(f"t{k:03d}" for k in range(10))
    assert f"blocked 45 dead letter(s): {named}, ... 35 more (--machines lists up to 20)\n" in status(url)
    named = ", ".join(f"t{k:03d}" for k in range(MAX_REASONS))
    assert (f"blocked 45 dead letter(s): {named}, and 25 more that status does not read (it reads at most 20 of a "
            "kind)\n") in status(url, "--machines")


def test_a_dead_letter_without_a_message_reads_the_same_in_the_text_and_on_the_page(tmp_path: Path):
    """The defect: the text view said "(no message)" where the page's "first line" cell was empty."""
    url = str(tmp_path / "queue")
    store = open_store(url)
    submit(store, None, [("t0", b"{}"), ("t1", b"{}")])
    name, body, metadata = marker_of({"task": "t0", "state": DEAD, "reason": EXPIRED, "errors": [], "worker": "w"})
    store.create(name, body, metadata=metadata)
    assert f"failed  x1 {EXPIRED} | t0: (no message)" in status(url)
    page = tmp_path / "status.html"
    status(url, "--html", str(page))
    assert "<td class='id'><code>t0</code></td> <td>(no message)</td>" in page.read_text()


def test_a_finished_queue_prints_no_rate_and_no_eta(tmp_path: Path):
    """The defect: a queue whose every task is done kept printing a falling rate and `eta 0.0s (0.0s to 0.0s)`."""
    from taskqueue.lease import DONE

    url = str(tmp_path / "queue")
    store = open_store(url)
    submit(store, None, [(f"t{k:03d}", b"{}") for k in range(6)])
    for k in range(6):
        name, body, metadata = marker_of({"task": f"t{k:03d}", "state": DONE, "worker": "w"})
        store.create(name, body, metadata=metadata)
    from reporting.status import render

    view = json.loads(status(url, "--json"))
    assert view["complete"]
    # The rate as the last done markers measured it (their spread in time; here written at once, so none).
    view.update(tasks_per_s=0.05, recent_done=6, eta_s=0.0, eta_range_s=[0.0, 0.0])
    text = render(view)
    assert "complete: every task has a done or failed marker" in text
    assert "eta " not in text and "rate " not in text
