"""The fleet as status shows it: one classification of each machine record (reporting/machinestate.py)
that the counts, the charts' data, the burn rate and the ETA all read, so they never contradict one
another; and a text view that fits a screen at a thousand machines."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet import machines
from reporting.fleetview import fleet_snapshot, render_fleet
from reporting.machinestate import DELETING_GONE_S, UP
from reporting.pricing import load_prices
from objectstore import open_store
from taskqueue import layout
from taskqueue.submit import submit
from tools import status as status_tool

REPO = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 11, 24, 8, 0, 0, tzinfo=dt.timezone.utc)
V5E_SPOT = 8 * 0.48  # v5litepod-8 spot per hour (reporting/prices.json)


def ago(seconds: float) -> dt.datetime:
    return NOW - dt.timedelta(seconds=seconds)


def record(store, name: str, state: str, last_s: float, since_s: float | None = None, **fields) -> None:
    """Machine `name`'s record as last written `last_s` seconds before NOW (its current spell began `since_s` ago)."""
    fields = {"machine_type": "v5litepod-8", "provisioning": "spot", "accelerator": "tpu", "beat_s": 60.0, **fields}
    since = ago(since_s if since_s is not None else last_s)
    machines.write_record(store, machines.make_record(name, state, at=ago(last_s), since=since.isoformat(), **fields))


def status(url: str, *args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert status_tool.main([url, "--now", NOW.isoformat(), *args]) == 0
    return out.getvalue()


def test_a_silent_machine_is_never_counted_as_working_or_booting(tmp_path: Path):
    """The contradiction: "Machines by state" counted 3 silent machines as working or booting while
    the ETA said 2 machines were up. Now each machine has one condition, and every figure reads it."""
    url = str(tmp_path / "queue")
    store = open_store(url)
    submit(store, None, [(f"t{k}", b"{}") for k in range(4)])
    record(store, "vm-1", "working", 10, 200, task="t0")
    record(store, "vm-2", "working", 30, 400, task="t1")
    record(store, "vm-3", "working", 100, 300, task="t2")  # missed its 60 s beat: silent
    record(store, "vm-4", "idle", 400, 900)  # silent for over three beats: lost
    record(store, "vm-5", "booting", 2400, spent={})  # 40 minutes booting without a record: lost
    view = json.loads(status(url, "--json"))
    fleet = view["fleet"]
    assert fleet["by_state"] == {"working": 2, "silent": 1, "lost": 2}
    assert (fleet["silent"], fleet["lost"]) == (["vm-3"], ["vm-4", "vm-5"])
    assert view["workers_up"] == fleet["workers_up"] == sum(fleet["by_state"].get(c, 0) for c in UP) == 2
    assert fleet["cost"]["burn_per_hour"] == round(2 * V5E_SPOT, 4)
    assert [a["machine"] for a in fleet["attention"]] == ["vm-4", "vm-5", "vm-3"]  # lost first
    assert "fleet   5 machines: up 2 (working 2), silent 1, lost 2" in status(url)
    page = tmp_path / "status.html"
    status(url, "--html", str(page))
    text = page.read_text()
    for condition, count in fleet["by_state"].items():
        assert f'data-key="fleet.by_state.{condition}" data-value="{count}"' in text
    assert 'data-key="fleet.by_state.booting"' not in text


def test_a_record_that_misses_its_beat_leaves_the_machines_up(tmp_path: Path):
    store = open_store(str(tmp_path / "queue"))
    record(store, "beat-60-89s", "working", 89)  # within 1.5 beats of 60 s
    record(store, "beat-60-91s", "working", 91)
    record(store, "beat-20-31s", "idle", 31, beat_s=20.0)  # a faster beat is held to its own
    record(store, "boot-29m", "installing", 29 * 60)  # boot records are not refreshed: 30 minutes
    view = fleet_snapshot(store, now=NOW)
    conditions = {m["machine"]: m["condition"] for m in view["roster"]}
    assert conditions == {"beat-20-31s": "silent", "beat-60-89s": "working", "beat-60-91s": "silent", "boot-29m": "installing"}


def test_preempted_machines_leave_the_fleet_up_and_stop_burning_at_once(tmp_path: Path):
    """The contradiction: 60 s after 6 of 8 spot machines were preempted the page said "8 machines
    up", idle 6, burning $30.72/h. Three saw the notice and wrote their final record (exited,
    preempted: spawn.py does so within the 30 s of notice); three were stopped without a word, their
    last beat 40 s before: they have missed it. Both kinds leave the count, the burn and the ETA."""
    url = str(tmp_path / "queue")
    store = open_store(url)
    submit(store, None, [(f"t{k}", b"{}") for k in range(20)])
    record(store, "vm-0", "working", 5, 50, task="t0")
    record(store, "vm-1", "working", 20, 70, task="t1")
    for k in (2, 3, 4):
        record(store, f"vm-{k}", "exited", 60, reason="preempted", spent={"working": 3000})
    for k in (5, 6, 7):
        record(store, f"vm-{k}", "idle", 100, 300, spent={"working": 3000})
    view = json.loads(status(url, "--json"))
    fleet = view["fleet"]
    assert fleet["by_state"] == {"working": 2, "silent": 3, "preempted": 3}
    assert view["workers_up"] == fleet["workers_up"] == 2
    assert fleet["cost"]["burn_per_hour"] == round(2 * V5E_SPOT, 4) == 7.68  # not 8 x 3.84 = 30.72
    assert "up 8" not in status(url)


def test_a_worker_that_sees_the_preemption_notice_records_it_and_leaves_the_fleet_up(tmp_path: Path, monkeypatch):
    """The real spawn.py on a (fake) spot VM: the notice makes it release its task and write its
    final record, `exited` with reason `preempted`, which status counts out of the fleet at once."""
    from tests.cloud.fakemetadata import FakeMetadata, gce_vm

    server = FakeMetadata().start()
    monkeypatch.setenv("GCE_METADATA_HOST", server.host)
    try:
        server.values.update(gce_vm("p", "us-central1-a", "spot-1"))
        server.values.update({"instance/machine-type": "projects/1/machineTypes/n2-standard-8",
                              "instance/scheduling/provisioning-model": "SPOT"})  # fmt: skip
        queue = tmp_path / "queue"
        store = open_store(str(queue))
        submit(store, b"{}", [("t1", json.dumps({"id": "t1", "outputs": 50, "sleep": 0.2}).encode())])
        consumer = f"{sys.executable} {REPO / 'tests' / 'queue' / 'consumer.py'}"
        worker = subprocess.Popen(
            [sys.executable, "spawn.py", str(queue), "--consumer", consumer, "--lease-ttl", "60", "--heartbeat", "0.3",
             "--idle-timeout", "1", "--poll", "0.1", "--preemption-watch", "on", "--machine-record", "on"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "SPAWN_MACHINE_BEAT_S": "0.2"})  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while [e.metadata.get("state") for e in store.list("machines/")] != ["working"]:
                assert time.monotonic() < deadline and worker.poll() is None, "the worker never recorded working"
                time.sleep(0.05)
            server.set("instance/preempted", "TRUE")
            assert worker.wait(timeout=20) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
        view = fleet_snapshot(store)
        assert view["by_state"] == {"preempted": 1} and view["workers_up"] == 0
        assert view["roster"][0]["machine_type"] == "n2-standard-8"
    finally:
        server.stop()


def shrunk_queue(url: str) -> dict:
    """Eight machines on tasks of two minutes finished one every 15 s until six were preempted, 60 s
    ago; the two left have finished one since. 20 tasks remain."""
    store = open_store(url)
    done = [ago(590 - 15 * k) for k in range(36)] + [ago(30)]
    submit(store, None, [(f"t{k:03d}", b"{}") for k in range(len(done) + 20)])
    for k, at in enumerate(done):
        meta = {"completed_at": at.isoformat(timespec="seconds"), "seconds": "120.0"}
        store.create(layout.done_object(f"t{k:03d}"), b"{}", metadata=meta)
    for k in range(2):
        record(store, f"vm-{k}", "working", 10, 40, spent={"booting": 60, "working": 5000})
    for k in range(2, 8):
        record(store, f"vm-{k}", "exited", 60, reason="preempted", spent={"booting": 60, "working": 5000})
    return {"done": len(done), "remaining": 20}


def test_eta_after_the_fleet_shrank_uses_the_machines_up_now(tmp_path: Path):
    """The contradiction: after the fleet shrank, the headline ETA used the 8-machine rate (1,546 s
    against a true 5,053 s). The rate is now scaled to the machines up, and the view says so."""
    url = str(tmp_path / "queue")
    queue = shrunk_queue(url)
    view = json.loads(status(url, "--json"))
    # By hand: 37 completions since the first, 590 s ago. While the rate was measured, 2 machines
    # worked all 590 s and 6 worked until 60 s ago: (2 x 590 + 6 x 530) / 590 = 7.39 on average.
    span, recent = 590, queue["done"]
    workers_recent = round((2 * 590 + 6 * 530) / 590, 2)
    at_recent_rate = round(20 / (recent / span), 1)  # 318.9 s: what the page said before
    assert (view["recent_done"], view["tasks_per_s"]) == (recent, round(recent / span, 4))
    assert view["fleet"]["workers_recent"] == workers_recent == 7.39
    assert view["fleet_changed"] == {"from": workers_recent, "to": 2, "eta_at_recent_rate_s": at_recent_rate}
    assert view["eta_s"] == round(at_recent_rate * workers_recent / 2, 1) == 1178.3
    # Two machines on tasks of two minutes take 20 minutes for 20 tasks: the ETA is within 2% of it.
    assert abs(view["eta_s"] - 1200) / 1200 < 0.02
    assert view["eta_fleet_s"] == math.ceil(20 / 2) * 120.0
    assert view["finish"]["dollars"] == round(2 * V5E_SPOT / 3600 * view["eta_s"], 4)
    text = status(url)
    assert "eta 19m38s" in text and "at the 2 machines up now; the rate was measured with 7.39 on average" in text


def test_fleet_snapshot_groups_failures_reads_their_log_tails_and_lists_every_machine(tmp_path: Path):
    store = open_store(str(tmp_path / "queue"))
    record(store, "w-1", "working", 5, task="t7")
    record(store, "w-2", "working", 5, task="t9")
    record(store, "w-3", "idle", 5)
    record(store, "w-4", "failed", 50, reason="install_failed: exit 1 at line 300", log_tail="pip says no")
    record(store, "w-5", "failed", 40, reason="install_failed: exit 1 at line 300")
    record(store, "w-6", "failed", 30, reason="missing_permission: compute.instances.delete on project p")
    record(store, "w-7", "deleting", 5, reason="queue drained")
    record(store, "tpu-1-w1", "failed", 20, reason="install_failed: exit 1 at line 300", host="1")  # a slice's host
    view = fleet_snapshot(store, now=NOW)
    assert (view["machines"], view["other_hosts"]) == (7, 1)
    assert view["by_state"] == {"working": 2, "idle": 1, "failed": 3, "deleting": 1}
    assert view["failures"] == {
        "install_failed: exit 1 at line 300": ["tpu-1-w1", "w-4", "w-5"],
        "missing_permission: compute.instances.delete on project p": ["w-6"],
    }
    assert view["log_tails"] == {"w-4": "pip says no"}  # the listing leaves it out; one read per failed record
    text = "\n".join(render_fleet(view))
    assert "failed x3: install_failed: exit 1 at line 300  [tpu-1-w1, w-4, w-5]" in text
    assert "w-1" not in text  # a working machine needs no attention
    everything = "\n".join(render_fleet(view, all_machines=True))
    assert "w-1" in everything and "t7" in everything and "w-7" in everything


def test_a_deleting_record_older_than_a_delete_can_take_reads_exited(tmp_path: Path):
    """The defect: machines that wrote `deleting` 40 minutes ago were still shown deleting. A
    self-delete is over (deleted, or powered off) within DELETING_GONE_S; past it the machine is gone."""
    store = open_store(str(tmp_path / "queue"))
    record(store, "vm-now", "deleting", 60, reason="queue drained", spent={"working": 600})
    record(store, "vm-edge", "deleting", DELETING_GONE_S, reason="queue drained")
    record(store, "vm-old", "deleting", 40 * 60, reason="queue drained", spent={"working": 600})
    view = fleet_snapshot(store, now=NOW, prices=load_prices())
    assert {m["machine"]: m["condition"] for m in view["roster"]} == {"vm-edge": "deleting", "vm-now": "deleting", "vm-old": "exited"}
    assert view["by_state"] == {"deleting": 2, "exited": 1} and view["workers_up"] == 0
    assert view["cost"]["burn_per_hour"] == 0 and view["cost"]["seconds"]["working"] == 1200  # its bill ended at the record


def test_the_deleting_bound_covers_what_a_self_delete_can_take():
    """DELETING_GONE_S holds the self-delete's retries (their waits) and its wait for the operation,
    with room for the power-off that follows a failed one (fleet/selfdelete.py's defaults)."""
    from fleet.selfdelete import SelfDeleter

    deleter = SelfDeleter(metadata=None)
    worst = (deleter.attempts - 1) * deleter.max_wait_s + deleter.operation_wait_s
    assert worst + 300 <= DELETING_GONE_S < 40 * 60


def test_no_machine_records_means_no_fleet_and_no_table_of_zeros(tmp_path: Path):
    """A local run writes no machine record: the views say so instead of pricing nothing."""
    url = str(tmp_path / "queue")
    submit(open_store(url), None, [("t1", b"{}")])
    text = status(url)
    assert "fleet   no machine records yet" in text and "spent" not in text and "waste" not in text
    page = tmp_path / "status.html"
    status(url, "--html", str(page))
    html = page.read_text()
    assert "No machine records yet" in html
    for zeros in ("cost-by-state", "cost-by-type", "machines-by-type", "class='warn'"):
        assert zeros not in html


def test_text_view_of_a_thousand_machines_fits_a_screen_and_machines_lists_them_all():
    """bench/status_bench.py's fleet (1,000 machines, a few failed, silent, lost or straggling) on a
    smaller queue: the default view is a screenful; --machines lists every machine and holder."""
    from tests.simworld.scheduler import EPOCH
    from bench.status_bench import build
    from reporting.pricing import load_prices
    from tools.status import job_view, render_text

    now = EPOCH + dt.timedelta(hours=6)  # as the bench
    store = build(5_000, 1000, 0.5)
    view = job_view(store, load_prices(), now, None, None)
    lines = render_text(view).splitlines()
    assert len(lines) <= 60, "\n".join(lines)
    assert max(len(line) for line in lines if line.startswith("holders")) <= 160
    assert any(line.startswith("attention 30 machines") for line in lines)
    everything = render_text(view, all_machines=True).splitlines()
    assert len(everything) > 1000 and sum(line.startswith("  vm-") for line in everything) >= 1000


def test_status_tool_shows_the_fleet_and_keeps_json(tmp_path: Path):
    queue = tmp_path / "queue"
    store = open_store(str(queue))
    machines.write_record(store, machines.make_record("w-1", "failed", reason="bad_attribute: spawn-code="))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "tools/status.py", str(queue), "--json"], cwd=REPO, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["fleet"]["failures"] == {"bad_attribute: spawn-code=": ["w-1"]}
    text = subprocess.run([sys.executable, "tools/status.py", str(queue)], cwd=REPO, capture_output=True, text=True, env=env)
    assert "fleet   1 machines: up 0, failed 1" in text.stdout


@pytest.mark.parametrize("beat", ["", "nan", "-5", "soon"])
def test_a_record_without_a_sane_beat_is_held_to_the_default(tmp_path: Path, beat: str):
    store = open_store(str(tmp_path / "queue"))
    body = machines.make_record("w", "working", at=ago(80), since=ago(80).isoformat())
    meta = {**machines.listed_metadata(body), **({"beat_s": beat} if beat else {})}
    store.put(machines.record_object("w"), json.dumps(body).encode(), metadata=meta)
    assert fleet_snapshot(store, now=NOW)["by_state"] == {"working": 1}  # 80 s < 1.5 x 60 s
