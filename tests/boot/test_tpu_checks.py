"""tests/boot/tpu_fleet.py's checks on a report made here, without the rehearsal's tools (no root, no boot): each
of the ways `breakages` breaks a report must add a problem to `check`'s, the records' ones included (a host with
no final record, a stale `idle` after a self-delete, a failed boot that does not say it was refused the code).
The rehearsal itself runs the same breakages on its real report (tests/boot/test_tpu_fleet.py)."""

from __future__ import annotations

import dataclasses
import types

import datetime as dt
import time
from pathlib import Path

from fleet.machines import make_record
from tests.boot import tpu_fleet
from tests.boot.machines import Command
from tests.boot.rehearsal import Disk

NOW = time.time()
REFUSED = ("code_sync_failed: permission denied: spawn-worker@test-project.iam.gserviceaccount.com does not have "
           "storage.objects.get access to the Google Cloud Storage object gs://rehearsal-bucket/code/tpu (grant the "
           "machines' service account roles/storage.objectUser on the bucket)")  # fmt: skip


def _host(node: str, index: int, hosts: int, end: str, state: str, reason: str = "", refused: bool = False):
    name = node if index == 0 else f"{node}-w{index}"
    record = make_record(name, state, at=dt.datetime.fromtimestamp(NOW, dt.timezone.utc), **(
        {"reason": reason} if reason else {}))  # fmt: skip
    return tpu_fleet.Host(name, Disk(Path("/nonexistent") / name), started=NOW - 100, ended=NOW + 100, end=end,
                          refused=refused, saved_log="", record=record, node=f"projects/p/locations/z/nodes/{node}",
                          index=index, hosts=hosts, address=f"10.0.1.{index + 2}")  # fmt: skip


def _report() -> tpu_fleet.TpuReport:
    hosts = [
        _host("slice16-0000", 0, 4, "preempted", "exited", "stopped (SIGTERM)"),
        _host("slice16-0000", 1, 4, "preempted", "exited", "follower stopped"),
        _host("slice16-0000", 2, 4, "killed (SIGKILL of its namespaces)", "idle"),
        _host("slice16-nocode8-0000", 0, 1, "self-deleted", "failed", REFUSED, refused=True),
        _host("slice16-single8-0000", 0, 1, "self-deleted", "deleting", "queue drained"),
    ]
    again = Command(["up"], 0, "up: (0 resources created now, 1 there already)", "", NOW, 1.0, [])
    return tpu_fleet.TpuReport(
        1.0, ["t000000"], hosts, [], {}, {tpu_fleet.SLICE_RUN: again}, "slice16-0000-w2", "t000000", 1, 5.0, {},
        again, again, {}, {"done/t000000.json": {"task": "t000000", "fencing_token": 2}}, {},
        {"jobs/tpu/out/t000000/a.safetensors": 1}, [], [], {"complete": True}, [], "t000000")  # fmt: skip


def test_the_records_of_each_way_a_tpu_host_ends_raise_no_problem_of_their_own():
    lines = tpu_fleet.check(_report())  # the report has no logs, hence other problems: the records' are not among them
    assert not [line for line in lines if "(boot 1, " in line or "failed boots" in line or "ended otherwise" in line]


def test_every_way_the_rehearsal_breaks_its_report_adds_a_problem():
    assert tpu_fleet.breakages(_report()) == []


def test_a_self_deleted_queued_resource_counts_the_deletes_of_hosts_not_downs_404():
    report = _report()
    for i, host in enumerate(report.hosts):
        host.api = types.SimpleNamespace(url=f"http://127.0.0.1:{1000 + i}")
    nocode, single, operator = "127.0.0.1:1003", "127.0.0.1:1004", "127.0.0.1:2000"

    def deleted_through(deletes):
        lines = tpu_fleet.check(dataclasses.replace(report, qr_deletes=deletes))
        return [line for line in lines if "deleted through" in line]

    # Each from its host 0, then down's own (answered 404): no problem.
    assert deleted_through([("slice16-nocode8-0000", nocode), ("slice16-single8-0000", single),
                            ("slice16-nocode8-0000", operator), ("slice16-single8-0000", operator)]) == []
    # Deleted twice by hosts, or only by down: each a problem.
    assert deleted_through([("slice16-nocode8-0000", nocode), ("slice16-single8-0000", single),
                            ("slice16-single8-0000", "127.0.0.1:1000")])
    assert deleted_through([("slice16-nocode8-0000", nocode), ("slice16-single8-0000", operator)])
