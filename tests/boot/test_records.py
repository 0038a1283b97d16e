"""tests/boot/records.py, the rehearsals' check of machine records, on records made as fleet/machines.py
makes them: each way a machine ends has its state and reason, and a record left by another boot, or a
stale one, is a problem naming the machine. Runs without the rehearsal's tools (no root, no rootfs)."""

from __future__ import annotations

import datetime as dt

from fleet.machines import make_record
from tests.boot.records import (
    CODE_REFUSED, FAILED_BOOT, FOLLOWER_STOPPED, KILLED, PREEMPTED, SELF_DELETED, SHUT_DOWN, Ending, problems,
)  # fmt: skip

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


def test_a_tpu_slices_endings_each_with_its_own_final_record_pass():
    """The TPU rehearsal's endings: a host 0 shut down by a preemption (SIGTERM, no notice), its followers, the
    killed follower's last `idle`, and a boot refused the code, whose reason names the refusal as startup.sh
    words it (tests/cloud/test_startup.py pins that wording)."""
    refused = ("code_sync_failed: permission denied: spawn-worker@test-project.iam.gserviceaccount.com does not have "
               "storage.objects.list access to the Google Cloud Storage bucket gs://rehearsal-bucket/code/tpu (grant "
               "the machines' service account roles/storage.objectUser on the bucket)")  # fmt: skip
    endings = [
        _ending("s-0000", 1, SHUT_DOWN, _record("s-0000", "exited", BOOT1 + 200, reason="stopped (SIGTERM)"), BOOT1),
        _ending("s-0000-w1", 1, FOLLOWER_STOPPED, _record("s-0000-w1", "exited", BOOT1 + 200,
                                                          reason="follower stopped", role="follower"), BOOT1),
        _ending("s-0000-w2", 1, KILLED, _record("s-0000-w2", "idle", BOOT1 + 100, role="follower"), BOOT1),
        Ending("n-0000", 1, FAILED_BOOT, _record("n-0000", "failed", BOOT1 + 20, reason=refused), BOOT1, BOOT1 + 30,
               CODE_REFUSED),
    ]  # fmt: skip
    assert problems(endings) == []


def test_a_failed_boot_that_does_not_say_it_was_refused_the_code_fails():
    """Issue 48's false reasons: the line number of the failing command is not why."""
    record = _record("n-0000", "failed", BOOT1 + 20, reason="code_sync_failed: exit 1 at line 564")
    found = problems([Ending("n-0000", 1, FAILED_BOOT, record, BOOT1, BOOT1 + 30, CODE_REFUSED)])
    assert len(found) == 1 and "exit 1 at line 564" in found[0], found


def test_a_killed_host_with_a_final_record_or_a_preempted_host_that_says_preempted_on_a_tpu_fails():
    """A killed host can write nothing more: a final record there was not its own; a TPU VM's worker gets no
    preemption notice, only the shutdown's SIGTERM, so `preempted` would be a reason it cannot know."""
    found = problems([
        _ending("s-0000-w2", 1, KILLED, _record("s-0000-w2", "exited", BOOT1 + 100, reason="follower stopped"), BOOT1),
        _ending("s-0000", 1, SHUT_DOWN, _record("s-0000", "exited", BOOT1 + 100, reason="preempted"), BOOT1),
    ])  # fmt: skip
    assert len(found) == 2 and "state='exited'" in found[0] and "reason='preempted'" in found[1], found
