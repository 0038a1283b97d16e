"""The whole fleet rehearsed (tests/boot/fleet.py) at CI's size, driven by `gcs-spawner` as an operator drives it:
a run file, then `gcs-spawner up run.yaml --yes` in a process of its own (the pre-flight against the fakes, the
model mirrored, the code with its wheelhouse and interpreter uploaded, 3 tasks on the tiny model submitted, the
template and a group of 3 created); each member booted by the fake Compute API as a rehearsal machine with its own
metadata, the real startup.sh and gcloud, one of them refused the code by the bucket (a failed boot: it records why
and leaves its group); one machine preempted mid-task and recreated by its group while the same `up` runs again and
creates nothing; a late `gcs-spawner submit` of 1 task; every machine leaving through deleteInstances; `gcs-spawner
down run.yaml` (no --yes: only a complete job goes on) deleting exactly what up recorded; nothing left; every boot's
last machine record saying how it ended (tests/boot/records.py: self-deleted, preempted, recreated, failed boot).
`make rehearsal` runs the full size (3 working machines and the failed one, 6 + 2 tasks), with the same checks.
Needs what tests/boot/test_first_boot.py needs; skips (outside CI) without."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.boot.fleet import check, rehearse
from tests.boot.rehearsal import REPO, skip_or_fail_without_the_tools

pytestmark = pytest.mark.timeout(1800)


def test_a_fleet_lives_from_up_to_down_through_a_preemption_a_second_up_and_a_late_submit(tmp_path):
    skip_or_fail_without_the_tools()
    report = rehearse(tmp_path, machines=2, first=3, late=1)
    print("\n" + "\n".join(report.lines()))
    assert check(report) == []


@pytest.mark.parametrize(("ci", "code", "verb"), [(None, 0, "skipped"), ("1", 1, "failed")])
def test_make_rehearsal_without_its_tools_says_why_in_one_line_and_skips_or_fails_in_ci(ci, code, verb):
    """`make rehearsal` (python -m tests.boot.fleet) on a machine without its tools (here: a PATH with
    none of them): one line saying what is missing, exit 0 (a skip), or 1 where CI requires the
    rehearsal; no RootfsError traceback (issue 48)."""
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "BOOT_REHEARSAL")}
    env.update({"PATH": "/nonexistent", **({"CI": ci} if ci else {})})
    result = subprocess.run([sys.executable, "-m", "tests.boot.fleet"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == code, result.stderr
    assert result.stderr.startswith(f"fleet rehearsal {verb}: the boot rehearsal needs mmdebstrap;"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
