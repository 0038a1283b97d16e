"""tests/boot/records.py, the rehearsals' check of machine records, on records made as fleet/machines.py
makes them: each way a machine ends has its state and reason, and a record left by another boot, or a
stale one, is a problem naming the machine. Runs without the rehearsal's tools (no root, no rootfs)."""

from __future__ import annotations

import datetime as dt

from fleet.machines import make_record
from tests.boot.records import FAILED_BOOT, PREEMPTED, SELF_DELETED, Ending, problems

BOOT1, BOOT2 = 1_790_000_000.0, 1_790_000_600.0  # epoch seconds: a first boot, and its recreation 10 minutes on


def _record(name: str, state: str, at: float, **fields: object) -> dict:
    return make_record(name, state, at=dt.datetime.fromtimestamp(at, dt.timezone.utc), **fields)


def _ending(name: str, boot: int, how: str, record: dict | None, started: float) -> Ending:
    return Ending(name, boot, how, record, started=started, ended=started + 300)


def test_each_way_a_machine_ends_with_its_own_final_record_passes():
    endings = [
        _ending("fleet-a", 1, SELF_DELETED, _record("fleet-a", "deleting", BOOT1 + 290, reason="queue drained"), BOOT1),
        _ending("fleet-b", 1, PREEMPTED, _record("fleet-b", "exited", BOOT1 + 120, reason="preempted"), BOOT1),
        _ending("fleet-b", 2, SELF_DELETED, _record("fleet-b", "deleting", BOOT2 + 200, reason="queue idle"), BOOT2),
        _ending("fleet-c", 1, FAILED_BOOT, _record("fleet-c", "failed", BOOT1 + 30,
                                                    reason="install_failed: exit 1 at line 312"), BOOT1),
    ]  # fmt: skip
    assert problems(endings) == []


def test_a_worker_that_never_wrote_its_final_record_leaves_a_stale_idle_record_that_fails():
    stale = _record("fleet-a", "idle", BOOT1 + 250, last_task="t-0003")
    found = problems([_ending("fleet-a", 1, SELF_DELETED, stale, BOOT1)])
    assert len(found) == 1 and found[0].startswith("fleet-a (boot 1, self-deleted): the last record says state='idle'")


def test_a_preempted_machine_that_exits_without_saying_preempted_fails():
    found = problems([_ending("fleet-b", 1, PREEMPTED, _record("fleet-b", "exited", BOOT1 + 9, reason="stopped"), BOOT1)])
    assert len(found) == 1 and "reason='stopped'" in found[0], found


def test_a_drained_queue_with_dead_letters_is_not_the_clean_self_delete_expected():
    record = _record("fleet-a", "deleting", BOOT1 + 290, reason="queue drained with 2 dead letters")
    assert len(problems([_ending("fleet-a", 1, SELF_DELETED, record, BOOT1)])) == 1


def test_a_recreated_machine_with_only_its_preempted_boots_record_fails():
    """The group made fleet-b again, and that boot wrote nothing: the record is the first boot's."""
    first = _record("fleet-b", "deleting", BOOT1 + 120, reason="queue drained")  # right state, wrong boot
    found = problems([_ending("fleet-b", 2, SELF_DELETED, first, BOOT2)])
    assert len(found) == 1 and "not during this boot" in found[0], found


def test_no_record_or_another_machines_record_fails():
    other = _record("fleet-z", "deleting", BOOT1 + 290, reason="queue drained")
    found = problems([_ending("fleet-a", 1, SELF_DELETED, None, BOOT1),
                      _ending("fleet-a", 1, SELF_DELETED, other, BOOT1)])  # fmt: skip
    assert found == ["fleet-a (boot 1, self-deleted): no record in machines/fleet-a.json",
                     "fleet-a (boot 1, self-deleted): the record names machine 'fleet-z'"]  # fmt: skip


def test_the_state_is_checked_as_well_as_the_reason():
    """The right reason in the wrong state (an `exited` where the machine deleted itself) is a problem too."""
    record = _record("fleet-a", "exited", BOOT1 + 290, reason="queue drained")
    found = problems([_ending("fleet-a", 1, SELF_DELETED, record, BOOT1)])
    assert len(found) == 1 and "state='exited'" in found[0], found
