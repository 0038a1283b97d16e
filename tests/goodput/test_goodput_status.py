"""Status shows the fleet's goodput beside its cost: from the done markers' phase counters (extract/phases.py, summed
by the queue), worked out by hand below, in --json, the text and the page; the other counters are listed as
before, without the phases."""

from __future__ import annotations

import json

import pytest

from extract.phases import ATTEMPTS, counter_name
from objectstore import open_store
from taskqueue import layout
from tests.status.test_cost import DOLLARS, DataKeys, ago, build_queue, fixed_prices, status  # noqa: F401 (fixed_prices: autouse, the pinned prices the dollars use)

# Two finished tasks' phases in ms, as their done markers' counters carry them (t01 took two attempts).
T01 = {"imports": 3000, "devices": 500, "weights": 20000, "prepare": 1500, "trace": 2000, "compile": 9000,
       "first_step": 1000, "steady": 300000, "tail": 2000}  # fmt: skip
T02 = {"imports": 2000, "devices": 400, "weights": 1000, "prepare": 1200, "trace": 1800, "compile": 300,
       "first_step": 600, "steady": 310000, "tail": 1700}  # fmt: skip
WALL_S = (sum(T01.values()) + sum(T02.values())) / 1000  # 658.0
STEADY_S = 610.0
FIXED_S = WALL_S - STEADY_S  # 48.0, over 3 attempts
WORKING_DOLLARS = DOLLARS["working"]  # the working dollars of tests/status/test_cost.py


def marker_counters(phases: dict[str, int], attempts: int, **others: int) -> str:
    return json.dumps({**{counter_name(p): ms for p, ms in phases.items()}, ATTEMPTS: attempts, **others})


def test_goodput_and_the_fixed_seconds_cost_are_shown_beside_the_cost(tmp_path):
    url = str(tmp_path / "queue")
    build_queue(url)  # nine done markers (one counting 3 skipped rows) and the cost test's machines
    store = open_store(url)
    for task, phases, attempts in (("t01", T01, 2), ("t02", T02, 1)):
        store.delete(layout.done_object(task))
        others = {"skipped_rows": 3} if task == "t01" else {}
        meta = {"completed_at": ago(60 * int(task[1:])), "seconds": "100.0", "counters": marker_counters(phases, attempts, **others)}
        store.create(layout.done_object(task), b"{}", metadata=meta)

    view = json.loads(status(url, "--json"))
    assert view["counters"] == {"skipped_rows": 3}  # the phases are summarised apart, not listed
    goodput = view["goodput"]
    assert goodput["goodput"] == round(STEADY_S / WALL_S, 4) == 0.9271
    assert (goodput["attempts"], goodput["wall_s"], goodput["fixed_s"]) == (3, WALL_S, FIXED_S)
    assert goodput["fixed_s_per_attempt"] == 16.0
    assert goodput["phases_s"]["weights"] == 21.0 and goodput["phases_s"]["compile"] == 9.3
    assert goodput["working_dollars"] == pytest.approx(round(WORKING_DOLLARS, 4))
    assert goodput["fixed_dollars"] == pytest.approx(round(goodput["working_dollars"] * FIXED_S / WALL_S, 4))

    text = status(url)
    assert ("goodput 92.7% of consumer time in the steady forward over 3 attempts; fixed 16.0 s an attempt (imports "
            "1.7, devices 0.3, weights 7.0, prepare 0.9, trace 1.3, compile 3.1, first step 0.5, tail 1.2); "
            f"~${goodput['fixed_dollars']:,.2f} of ${goodput['working_dollars']:,.2f} working") in text
    assert "counted skipped_rows=3" in text and "goodput_ms" not in text

    page_file = tmp_path / "status.html"
    status(url, "--html", str(page_file))
    keys = DataKeys()
    keys.feed(page_file.read_text())
    assert {k: keys.values.get(k) for k in ("goodput.goodput", "goodput.fixed_s_per_attempt", "goodput.attempts",
                                            "goodput.fixed_dollars")} == {
        "goodput.goodput": "0.9271", "goodput.fixed_s_per_attempt": "16.0", "goodput.attempts": "3",
        "goodput.fixed_dollars": str(goodput["fixed_dollars"])}  # fmt: skip
    assert "goodput_ms" not in page_file.read_text()


def test_without_reported_phases_status_shows_no_goodput(tmp_path):
    url = str(tmp_path / "queue")
    build_queue(url)
    view = json.loads(status(url, "--json"))
    assert view["goodput"] is None and "goodput" not in status(url)
