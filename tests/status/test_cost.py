"""Cost, waste and ETA of a queue whose machine records and done markers are written at known times:
the figures are worked out by hand below, and `tools/status.py` must print exactly them in --json,
in the text and on the HTML page."""

from __future__ import annotations

import contextlib
import datetime as dt
import html.parser
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet import machines
from objectstore import open_store
from taskqueue import layout
from taskqueue.submit import submit
from tools import status as status_tool

REPO = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 11, 23, 12, 0, 0, tzinfo=dt.timezone.utc)
V5E_SPOT = 8 * 0.48  # v5litepod-8: 8 chips at the spot price per chip-hour of PRICES below
A2_ON_DEMAND = 3.67  # a2-highgpu-1g on demand, per machine-hour
BAD_ROW = "file data/part-0.parquet row 17 (sample id s-17): text is null"


PRICES: Path | None = None  # the price table status reads here (fixed_prices)


@pytest.fixture(scope="module", autouse=True)
def fixed_prices(tmp_path_factory):
    """The shipped table with the two prices the hand figures use pinned, so a refresh of
    reporting/prices.json from Google's pages leaves these figures standing."""
    global PRICES
    from reporting.pricing import PRICES_FILE

    raw = json.loads(PRICES_FILE.read_text())
    raw["tpu"]["v5e"]["spot_per_chip_hour"] = V5E_SPOT / 8
    raw["gpu_machines"]["a2-highgpu-1g"]["on_demand_per_hour"] = A2_ON_DEMAND
    PRICES = tmp_path_factory.mktemp("prices") / "prices.json"
    PRICES.write_text(json.dumps(raw))
    yield PRICES
    PRICES = None


def ago(seconds: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds)).isoformat(timespec="seconds")


def machine(store, name, state, since_s, at_s, spent, machine_type, provisioning, **fields):
    body = machines.make_record(name, state, at=NOW - dt.timedelta(seconds=at_s), since=ago(since_s), spent=spent,
                                machine_type=machine_type, provisioning=provisioning, accelerator="tpu", **fields)  # fmt: skip
    machines.write_record(store, body)


def build_queue(url: str) -> None:
    store = open_store(url)
    tasks = [(f"t{k:02d}", json.dumps({"id": f"t{k:02d}"}).encode()) for k in range(20)]
    submit(store, b'{"name": "cost"}', tasks)
    # Nine done markers, one a minute over the last nine minutes, taking 100..180 s each (median 140).
    for k in range(1, 10):
        meta = {"completed_at": ago(60 * k), "seconds": str(90.0 + 10 * k)}
        if k == 1:
            meta["counters"] = '{"skipped_rows":3}'
        store.create(layout.done_object(f"t{k:02d}"), b"{}", metadata=meta)
    letter = {"task": "t10", "reason": "consumer exit 65: bad input",
              "errors": [{"exit_code": 65, "error": f"loading\nevent=bad_input exit=65 error={BAD_ROW}\nmore context"}]}  # fmt: skip
    store.create(layout.failed_object("t10"), json.dumps(letter).encode())
    v5e, a2 = "v5litepod-8", "a2-highgpu-1g"
    # m1: on one task for 500 s (> 3 x 140: a straggler); m2 idle; m3 failed its boot; m4 on demand;
    # m5 an unpriced type; m6's last record is 1000 s old: lost, priced until it was declared lost
    # (its last record + 3 beats of 60 s), since nothing says it stopped before.
    machine(store, "m1", "working", 500, 30, {"booting": 120, "installing": 300, "working": 3000, "idle": 60}, v5e, "spot", task="t11")
    machine(store, "m2", "idle", 100, 10, {"booting": 100, "installing": 200, "working": 2000}, v5e, "spot")
    machine(store, "m3", "failed", 1000, 1000, {"booting": 90, "installing": 210}, v5e, "spot", reason="install_failed: exit 1")
    machine(store, "m4", "working", 200, 20, {"booting": 60, "installing": 240, "working": 1000}, a2, "standard", task="t12")
    machine(store, "m5", "working", 100, 5, {}, "e2-standard-4", "standard", task="t13")
    machine(store, "m6", "working", 2000, 1000, {"working": 500}, v5e, "spot", task="t14")


# The figures, by hand.
SECONDS = {"booting": 120 + 100 + 60, "installing": 300 + 200 + 240, "working": 3500 + 2000 + 1680 + 1200,
           "idle": 60 + 100, "failed": 90 + 210}  # fmt: skip
V5E_S = {"booting": 220, "installing": 500, "working": 7180, "idle": 160, "failed": 300}
A2_S = {"booting": 60, "installing": 240, "working": 1200, "idle": 0, "failed": 0}
DOLLARS = {s: round(V5E_S[s] * V5E_SPOT / 3600 + A2_S[s] * A2_ON_DEMAND / 3600, 4) for s in V5E_S}
TOTAL = (sum(V5E_S.values()) * V5E_SPOT + sum(A2_S.values()) * A2_ON_DEMAND) / 3600  # 10.4465
WASTE_S = 280 + 740 + 160 + 300
WASTE = (1180 * V5E_SPOT + 300 * A2_ON_DEMAND) / 3600  # 1.5645
BURN = 2 * V5E_SPOT + A2_ON_DEMAND  # m1, m2, m4 are up; m5 is unpriced, m6 silent, m3 gone
# Nine completions in the 540 s since the first of the window: 1/60 per s; 10 tasks remain (20 - 9 - 1).
ETA = 10 / (9 / 540)  # 600 s
ETA_RANGE = [10 / ((9 + 6) / 540), 10 / ((9 - 6) / 540)]  # +-2 sqrt(9): 360 s and 1800 s
# The fleet's side: m1, m2, m4, m5 are up, so 10 tasks take ceil(10 / 4) = 3 waves of the 140 s median.
ETA_FLEET = 3 * 140.0  # 420 s, inside the range


def status(url: str, *args: str) -> str:
    """What `tools/status.py URL --now NOW ARGS` prints (run in this process: the imports are paid once)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert status_tool.main([url, "--now", NOW.isoformat(), "--prices", str(PRICES), *args]) == 0
    return out.getvalue()


class DataKeys(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.values: dict[str, str] = {}

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "data-key" in attrs:
            self.values[attrs["data-key"]] = attrs["data-value"]


def test_cost_waste_and_eta_equal_the_hand_figures_in_json_text_and_html(tmp_path: Path):
    url = str(tmp_path / "queue")
    build_queue(url)
    view = json.loads(status(url, "--json"))
    cost = view["fleet"]["cost"]
    assert cost["seconds"] == pytest.approx(SECONDS, abs=0)
    assert cost["dollars"] == DOLLARS
    assert cost["total_seconds"] == sum(SECONDS.values()) == 9860
    assert cost["total_dollars"] == round(TOTAL, 4) == 10.4465
    assert (cost["waste_seconds"], cost["waste_dollars"]) == (WASTE_S, round(WASTE, 4)) == (1480, 1.5645)
    assert cost["burn_per_hour"] == round(BURN, 4) == 11.35
    assert cost["unpriced_seconds"] == {"e2-standard-4": 100.0}
    assert [(g["machine_type"], g["provisioning"], g["machines"]) for g in cost["by_type"]] == [
        ("a2-highgpu-1g", "standard", 1), ("v5litepod-8", "spot", 4)]  # fmt: skip
    assert (view["done"], view["failed"], view["total"], view["recent_done"]) == (9, 1, 20, 9)
    assert view["eta_s"] == round(ETA, 1) == 600.0
    assert view["eta_range_s"] == [round(x, 1) for x in ETA_RANGE] == [360.0, 1800.0]
    assert view["median_task_s"] == 140.0
    assert (view["workers_up"], view["eta_fleet_s"]) == (4, ETA_FLEET)
    # While the rate was measured (the 540 s since the first completion of the window) m1, m2 and m4
    # worked throughout and m5 for its last 100 s; m6's last record is older: 3.19 machines on
    # average, within one machine of the 4 up, so the rate stands as measured.
    assert (view["fleet"]["workers_recent"], view["fleet_changed"]) == (round((3 * 540 + 100) / 540, 2), None)
    finish = view["finish"]
    assert finish["dollars"] == round(BURN * ETA / 3600, 4) == 1.8917
    assert finish["dollars_range"] == [round(BURN * e / 3600, 4) for e in ETA_RANGE] == [1.135, 5.675]
    assert finish["dollars_per_task"] == round(TOTAL / 9, 4)
    assert view["fleet"]["stragglers"] == [{"machine": "m1", "task": "t11", "held_s": 500.0, "median_task_s": 140.0}]
    assert (view["fleet"]["silent"], view["fleet"]["lost"]) == ([], ["m6"])  # 1000 s without a record: lost
    assert view["failed_details"] == {"t10": BAD_ROW}

    text = status(url)
    assert "spent   $10.45 over 2.74 machine-hours" in text
    assert "waste   $1.56, 0.41 machine-hours (boot, install, idle, failed boots)" in text
    assert "finish  $1.89 more ($1.14 to $5.67) at $11.35/h" in text
    assert "eta 10m00s (6m00s to 30m00s) at that rate" in text
    assert "the 4 machines up running the 2m20s median task back to back: 7m00s" in text
    assert view["eta_gap"] is None and "x slower" not in text  # 600 s against 420 s: near enough to say nothing
    assert f"failed  x1 consumer exit 65: bad input | t10: {BAD_ROW}" in text
    assert "m1  straggler on t11 for 8m20s" in text  # 500 s, over 3 x the 140 s median

    page_file = tmp_path / "status.html"
    status(url, "--html", str(page_file))
    page = page_file.read_text()
    keys = DataKeys()
    keys.feed(page)
    expected = {"fleet.cost.total_dollars": "10.4465", "fleet.cost.waste_dollars": "1.5645",
                "fleet.cost.waste_seconds": "1480.0", "finish.dollars": "1.8917", "finish.dollars_range.0": "1.135",
                "finish.dollars_range.1": "5.675", "eta_s": "600.0", "eta_range_s.0": "360.0",
                "eta_range_s.1": "1800.0", "done": "9", "total": "20", "counters.skipped_rows": "3",
                **{f"fleet.cost.dollars.{s}": str(d) for s, d in DOLLARS.items()}}  # fmt: skip
    assert {k: keys.values.get(k) for k in expected} == expected
    assert BAD_ROW in page
    # Self-contained: nothing fetched (no script, stylesheet link, image source or CSS import).
    for fetch in ("<script", "<link", "src=", "@import", "url(http", "href=\"http"):
        assert fetch not in page
    assert page.count("<svg") == 6  # three charts, each drawn for a phone and for a wide screen


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_publish_writes_the_page_to_the_queue_as_html(where: str, tmp_path: Path, request):
    if where == "gcs":
        client = request.getfixturevalue("gcs_client")  # exports STORAGE_EMULATOR_HOST to the tool
        bucket = request.getfixturevalue("gcs_bucket")
        url = f"gs://{bucket}/jobs/cost"
    else:
        url = str(tmp_path / "queue")
    build_queue(url)
    status(url, "--publish")
    [entry] = list(open_store(url).list("status.html"))
    assert entry.content_type == "text/html; charset=utf-8"
    assert open_store(url).read("status.html").data.startswith(b"<!DOCTYPE html>")
    if where == "gcs":  # what a browser is told, as the Google client reads it from the server
        assert client.bucket(bucket).get_blob("jobs/cost/status.html").content_type == "text/html; charset=utf-8"


def test_fleet_size_widens_the_eta_range_and_no_machine_up_means_no_eta():
    from reporting.status import with_fleet_size

    view = {"total": 100, "done": 40, "failed": 0, "median_task_s": 60.0, "eta_s": 600.0, "eta_range_s": [500.0, 700.0]}
    # 60 tasks on 2 machines: 30 waves of a minute, slower than the recent rate says.
    assert with_fleet_size(dict(view), 2)["eta_range_s"] == [500.0, 1800.0]
    assert with_fleet_size(dict(view), 60)["eta_range_s"] == [60.0, 700.0]
    gone = with_fleet_size(dict(view), 0)
    assert (gone["eta_s"], gone["eta_range_s"]) == (None, None)
    assert with_fleet_size(dict(view), None)["eta_range_s"] == [500.0, 700.0]  # no records: rate only


def test_watch_with_publish_refreshes_the_page(tmp_path: Path):
    url = str(tmp_path / "queue")
    build_queue(url)  # 10 tasks remain: the watch goes on until stopped
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "tools/status.py", url, "--publish", "--watch", "0.2"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    store = open_store(url)
    generations: set[int] = set()
    try:
        deadline = dt.datetime.now() + dt.timedelta(seconds=60)
        while len(generations) < 2 and dt.datetime.now() < deadline and proc.poll() is None:
            generations |= {e.generation for e in store.list("status.html")}
            time.sleep(0.05)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert len(generations) >= 2, err  # written, then rewritten


def test_dead_letter_first_line_prefers_the_message_then_the_bad_input_line_then_the_last_line():
    from reporting.status import first_line

    tail = "Traceback (most recent call last):\n  File x\nValueError: shard 3 is short\n"
    assert first_line({"message": "file a.jsonl row 4 (sample id 9): missing_field 'text'\nmore"}) == (
        "file a.jsonl row 4 (sample id 9): missing_field 'text'")  # fmt: skip
    assert first_line({"errors": [{"error": "x"}, {"error": f"log\nevent=bad_input exit=65 error={BAD_ROW}\n"}]}) == BAD_ROW
    assert first_line({"errors": [{"error": tail}]}) == "ValueError: shard 3 is short"
    assert first_line({"reason": "its lease expired 3 times", "errors": []}) is None


def test_machine_time_is_in_machine_hours_on_the_page_as_in_the_text(tmp_path: Path):
    """The defect: the page gave machine-seconds where the text view gave machine-hours. Both now
    give machine-hours, the same figures; the JSON keeps the seconds it is computed in."""
    url = str(tmp_path / "queue")
    build_queue(url)
    text = status(url)
    page_file = tmp_path / "status.html"
    status(url, "--html", str(page_file))
    page = page_file.read_text()
    assert "machine-seconds" not in page and " s of boot" not in page and f"({WASTE_S}s" not in text
    hours = {s: f"{SECONDS[s] / 3600:,.2f}" for s in SECONDS}
    for state, shown in hours.items():
        assert f"{state} {shown}h" in text
        assert f'data-key="fleet.cost.seconds.{state}" data-value="{float(SECONDS[state])}">{shown}</span>' in page
    total, waste = f"{sum(SECONDS.values()) / 3600:,.2f}", f"{WASTE_S / 3600:,.2f}"
    assert f"over {total} machine-hours" in text and f">{total}</span> machine-hours" in page
    assert f"{waste} machine-hours (boot" in text and f">{waste}</span> machine-hours of boot" in page


def test_two_etas_far_apart_say_which_to_go_by_and_why():
    """The defect: "ETA 2h" and "20m in waves of the median task" side by side, with no word on which
    to trust. The ETA is the measured rate's; when the machines up running the median task back to
    back would be ETA_GAP times faster or slower, both views say so, and why."""
    from reporting.page import _eta_html, _Page
    from reporting.status import ETA_GAP, eta_text, with_fleet_size

    base = {"total": 100, "done": 40, "failed": 0, "median_task_s": 60.0, "tasks_per_s": 60 / 7200, "recent_done": 12,
            "complete": False}  # fmt: skip
    slow = with_fleet_size({**base, "eta_s": 7200.0, "eta_range_s": [6000.0, 9000.0]}, 3)  # 20 waves of 60 s: 1200 s
    assert slow["eta_fleet_s"] == 1200.0 and slow["eta_s"] == 7200.0  # the headline stays the measured rate's
    assert slow["eta_gap"] == {"ratio": 6.0, "rate_is": "slower"} and 6.0 >= ETA_GAP
    text = eta_text(slow)
    assert "eta 2h00m (20m00s to 2h30m) at that rate" in text
    assert "the 3 machines up running the 1m00s median task back to back: 20m00s" in text
    assert "the measured rate is 6x slower than that: time between tasks" in text and "the ETA goes by the measured rate" in text
    page = _eta_html(_Page(slow), slow)
    assert "at the measured rate" in page and "the measured rate is 6x slower than that" in page
    fast = with_fleet_size({**base, "eta_s": 200.0, "eta_range_s": [150.0, 300.0]}, 3)
    assert fast["eta_gap"] == {"ratio": 6.0, "rate_is": "faster"}
    assert "6x faster than that: workers without a machine record" in eta_text(fast)
    near = with_fleet_size({**base, "eta_s": 2000.0, "eta_range_s": [1500.0, 3000.0]}, 3)  # 1.7x: nothing to explain
    assert near["eta_gap"] is None and "x slower" not in eta_text(near) and "x faster" not in eta_text(near)


@pytest.mark.parametrize("counters, said", [({}, None), ({"skipped_rows": 0}, None), ({"skipped_rows": 3}, "3 rows skipped")])
def test_no_row_skipped_says_nothing(tmp_path: Path, counters: dict, said: str | None):
    """The defect: "0 rows skipped" under its own heading when nothing was skipped."""
    url = str(tmp_path / "queue")
    store = open_store(url)
    submit(store, None, [("t0", b"{}"), ("t1", b"{}")])
    meta = {"completed_at": ago(60), "seconds": "30"}
    if counters:
        meta["counters"] = json.dumps(counters)
    store.create(layout.done_object("t0"), b"{}", metadata=meta)
    page_file = tmp_path / "status.html"
    text = status(url, "--html", str(page_file))
    page = page_file.read_text()
    if said is None:
        assert "rows skipped" not in page and "Skipped rows" not in page and "skipped_rows" not in text
    else:
        assert f'data-value="3">3</span> rows skipped' in page and "counted skipped_rows=3" in text
