"""The TPU fleet rehearsed (tests/boot/tpu_fleet.py) at CI's size, on one queue: the run `slice16` driven by
`gcs-spawner` (a v5litepod-16 slice: 4 hosts, each booted from its own TPU VM metadata in namespaces of its own,
on a network between them, one jax.distributed program) and two v5litepod-8s added by `gcs-spawner add`, all from
the fake TPU API's queued resources; `up` twice (the second makes nothing), a follower SIGKILLed mid-task (the
attempt ends within the stated bound, the task completes on a retry, nothing is written twice), the slice
preempted and replaced by `keep`, the new slice preempted in the tail (the single host holding the last task)
and left alone by `keep`, the single host deleting its own queued resource, a host refused the code (a failed
boot: its record says why, and it deletes its queued resource), every host's final record (tests/boot/records.py),
`status`, `down` leaving nothing; then the checks tried against the report broken six ways, each of which must
fail them. `make rehearsal-tpu` runs the full size (6 tasks) with the same checks. Needs what
tests/boot/test_first_boot.py needs; skips (outside CI) without."""

from __future__ import annotations

import pytest

from tests.boot.rehearsal import skip_or_fail_without_the_tools
from tests.boot.tpu_fleet import breakages, check, rehearse

pytestmark = pytest.mark.timeout(2400)


def test_a_tpu_fleet_claims_as_a_slice_loses_a_host_heals_and_leaves(tmp_path):
    skip_or_fail_without_the_tools()
    report = rehearse(tmp_path, tasks=4)
    print("\n" + "\n".join(report.lines()))
    assert check(report) == []
    assert breakages(report) == []  # each way issues 43 and 48 name to break it fails the check
