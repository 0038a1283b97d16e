"""The whole fleet rehearsed (tests/boot/fleet.py) at CI's size, driven by `gcs-spawner` as an operator drives it:
a run file, then `gcs-spawner up run.yaml --yes` in a process of its own (the pre-flight against the fakes, the
model mirrored, the code with its wheelhouse and interpreter uploaded, 3 tasks on the tiny model submitted, the
template and a group of 2 created); each member booted by the fake Compute API as a rehearsal machine with its own
metadata, the real startup.sh and gcloud; one machine preempted mid-task and recreated by its group while the same
`up` runs again and creates nothing; a late `gcs-spawner submit` of 1 task; every machine leaving through
deleteInstances; `gcs-spawner down run.yaml` (no --yes: only a complete job goes on) deleting exactly what up
recorded; nothing left. `make rehearsal` runs the full size (3 machines, 6 + 2 tasks), with the same checks.
Needs what tests/boot/test_first_boot.py needs; skips (outside CI) without."""

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
