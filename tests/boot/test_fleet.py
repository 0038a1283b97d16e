"""The whole fleet rehearsed (tests/boot/fleet.py) at CI's size: a managed instance group of 2 rehearsal
machines, each booted by the fake Compute API from the real template with its own metadata, the real
startup.sh and gcloud, 3 tasks on the tiny model and 1 submitted late; one machine preempted mid-task
and recreated by its group, a second `up` that creates nothing, every machine leaving through
deleteInstances, `down` once status says complete, nothing left. `make rehearsal` runs the full size
(3 machines, 6 + 2 tasks). Needs what tests/boot/test_first_boot.py needs; skips (outside CI) without."""

from __future__ import annotations

import pytest

from tests.boot.fleet import check, rehearse
from tests.boot.rehearsal import skip_or_fail_without_the_tools

pytestmark = pytest.mark.timeout(1800)


def test_a_fleet_lives_from_up_to_down_through_a_preemption_a_second_up_and_a_late_submit(tmp_path):
    skip_or_fail_without_the_tools()
    report = rehearse(tmp_path, machines=2, first=3, late=1)
    print("\n" + "\n".join(report.lines()))
    assert check(report) == []
