"""taskqueue.lease on its own: a holder's every write, its tombstones and the markers copied from them.

In-process, on a local store and a clock the test sets, so that mutation testing (`make mutants`)
reaches every branch of the module: what a claim carries over, what each write puts in the body
and in the listing's metadata, which writes a lost or finished lease refuses, and what a done
marker or dead letter holds (docs/PROTOCOL.md, "Leases" and "Completion")."""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading

import pytest

from objectstore.local import LocalStore
from taskqueue import layout
from taskqueue.clock import Clock
from taskqueue.lease import (
    DEAD,
    DONE,
    FINISHED,
    HELD,
    REASON_METADATA_CHARS,
    RELEASED,
    HeldLease,
    LeaseLost,
    compact,
    encode,
    marker_of,
    new_lease_body,
    sum_counters,
    sum_metadata_counters,
)

T0 = dt.datetime(2026, 11, 28, 12, 0, tzinfo=dt.timezone.utc)


class SetClock(Clock):
    """Time the test sets: the monotonic clock and the wall clock move together, only when told."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 100.0
        self.waits: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> dt.datetime:
        return T0 + dt.timedelta(seconds=self.now - 100.0)

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        return stop.is_set()


def iso(after_s: float) -> str:
    return (T0 + dt.timedelta(seconds=after_s)).isoformat(timespec="milliseconds")


def claim(store, clock, task_id="t1", previous=None, ttl_s=30.0, sent_at=None) -> HeldLease:
    body = new_lease_body(task_id, "w1", ttl_s, clock, previous)
    data, metadata = encode(body)
    generation = store.create(layout.lease_object(task_id), data, metadata=metadata)
    return HeldLease(store, body, generation, clock, sent_at=sent_at)


def stored(store, name):
    """The object's body and the metadata its listing shows."""
    entry = next(e for e in store.list(name.split("/")[0] + "/") if e.name == name)
    return json.loads(store.read(name).data), dict(entry.metadata)


def test_a_first_claim_is_attempt_one_held_by_its_worker_with_nothing_carried_over():
    clock = SetClock()
    body = new_lease_body("t1", "w1", 30.0, clock)
    nonce = body.pop("nonce")
    assert len(nonce) == 32 and int(nonce, 16) >= 0
    assert body == {"task": "t1", "state": HELD, "worker": "w1", "attempt": 1, "ttl_s": 30.0, "claimed_at": iso(0),
                    "heartbeat_at": iso(0), "progress": [], "errors": [], "takeovers": 0}  # fmt: skip
    assert new_lease_body("t1", "w1", 30.0, clock)["nonce"] != nonce  # each claim its own


def test_a_claim_after_failed_attempts_carries_their_errors_progress_and_counts_a_takeover_only_of_a_held_lease():
    clock = SetClock()
    previous = {"state": RELEASED, "errors": [{"e": 1}, {"e": 2}], "progress": [{"shard": 0}], "takeovers": 3}
    body = new_lease_body("t1", "w2", 30.0, clock, previous)
    assert (body["attempt"], body["errors"], body["progress"], body["takeovers"]) == (3, [{"e": 1}, {"e": 2}], [{"shard": 0}], 3)
    assert body["errors"] is not previous["errors"] and body["progress"] is not previous["progress"]
    taken = new_lease_body("t1", "w2", 30.0, clock, {**previous, "state": HELD})  # a holder that stopped beating
    assert taken["takeovers"] == 4 and taken["attempt"] == 3
    assert new_lease_body("t1", "w2", 30.0, clock, {"state": HELD})["takeovers"] == 1


def test_counters_sum_per_name_over_integers_only_and_say_what_they_left_out(caplog):
    records = [
        {"shard": 0, "counters": {"rows": 3, "tokens": 10}},
        {"shard": 1, "counters": {"rows": 2, "flag": True, "ratio": 0.5}},
        {"shard": 2, "counters": [1, 2]},
        {"shard": 3},
        {"shard": 4, "counters": {"rows": 1}},
    ]
    with caplog.at_level(logging.WARNING, logger="taskqueue.lease"):
        assert sum_counters(records) == {"rows": 6, "tokens": 10}
    assert [r.getMessage() for r in caplog.records] == [
        "event=bad_counters record=1 name=flag value=True: not an integer, ignored",
        "event=bad_counters record=1 name=ratio value=0.5: not an integer, ignored",
        "event=bad_counters record=2 counters=[1, 2]: not an object, ignored",
    ]
    assert sum_counters([]) == {}


def test_metadata_counters_sum_the_json_ones_and_say_which_text_was_not_json(caplog):
    with caplog.at_level(logging.WARNING, logger="taskqueue.lease"):
        assert sum_metadata_counters(['{"rows":2}', "nope" + "x" * 300, '{"rows":5,"tokens":1}']) == {"rows": 7, "tokens": 1}
    assert [r.getMessage() for r in caplog.records] == [f"event=bad_counters metadata={'nope' + 'x' * 196!r}: not JSON, ignored"]


def test_a_lease_is_written_as_compact_json_with_a_listing_summary_and_counters_only_when_there_are_some():
    body = {"task": "t1", "state": HELD, "worker": "w1", "ttl_s": 30.0, "heartbeat_at": iso(5), "x": [1, 2]}
    data, metadata = encode(body)
    assert data == b'{"task":"t1","state":"held","worker":"w1","ttl_s":30.0,"heartbeat_at":"' + iso(5).encode() + b'","x":[1,2]}'
    assert metadata == {"state": "held", "worker": "w1", "ttl_s": "30.0", "heartbeat_at": iso(5)}
    assert encode({**body, "counters": {}})[1] == metadata
    assert encode({**body, "counters": {"z": 1, "a": 2}})[1] == {**metadata, "counters": '{"a":2,"z":1}'}
    assert compact({"b": [1, 2], "a": None}) == '{"a":null,"b":[1,2]}'


def test_a_done_marker_copies_its_tombstone_with_times_and_counters_in_its_metadata():
    tombstone = {"task": "t1", "state": DONE, "fencing_token": 7, "worker": "w1", "attempt": 2, "progress": [{"shard": 0}],
                 "claimed_at": iso(0), "completed_at": iso(9), "seconds": 9.5, "counters": {"rows": 4}, "errors": [{"e": 1}]}  # fmt: skip
    name, data, metadata = marker_of(tombstone)
    assert name == "done/t1.json"
    assert json.loads(data) == {"task": "t1", "fencing_token": 7, "worker": "w1", "attempt": 2, "outputs": [{"shard": 0}],
                                "claimed_at": iso(0), "completed_at": iso(9), "seconds": 9.5}  # fmt: skip
    assert data.startswith(b'{\n "task": "t1"')  # indented, for people reading it
    assert metadata == {"completed_at": iso(9), "seconds": "9.5", "counters": '{"rows":4}'}
    bare = {"task": "t2", "state": DONE}  # a tombstone settled on an existing marker: nothing to copy
    assert marker_of(bare)[2] is None
    assert json.loads(marker_of(bare)[1])["outputs"] == []
    assert marker_of({**bare, "seconds": 0.0})[2] == {"seconds": "0.0"}


def test_a_dead_letter_copies_the_reason_errors_and_token_and_carries_the_reason_cut_short_in_its_metadata():
    tombstone = {"task": "t1", "state": DEAD, "fencing_token": 7, "worker": "w1", "failed_at": iso(3), "reason": "r" * 300,
                 "errors": [{"e": 1}], "progress": [{"shard": 0}], "counters": {"rows": 1}}  # fmt: skip
    name, data, metadata = marker_of(tombstone)
    assert name == "failed/t1.json"
    assert json.loads(data) == {"task": "t1", "reason": "r" * 300, "errors": [{"e": 1}], "worker": "w1", "fencing_token": 7,
                                "failed_at": iso(3)}  # fmt: skip
    assert data.startswith(b'{\n "task": "t1"')
    assert REASON_METADATA_CHARS == 200 and metadata == {"reason": "r" * 200}
    assert marker_of({"task": "t1", "state": DEAD, "reason": ""})[2] is None
    assert marker_of({"task": "t1", "state": DEAD, "reason": 12})[2] == {"reason": "12"}


def test_a_held_lease_knows_its_token_attempt_outputs_and_where_its_outputs_go(tmp_path):
    store, clock = LocalStore(tmp_path / "q"), SetClock()
    lease = claim(store, clock, previous={"state": RELEASED, "errors": [{"e": 1}], "progress": [{"shard": 0}]})
    assert lease.token == lease.generation and lease.task_id == "t1"
    assert lease.attempt == 2 and isinstance(lease.attempt, int)
    assert lease.committed == [{"shard": 0}]
    lease.committed.append({"shard": 9})  # a copy: the caller cannot change what is committed
    assert lease.committed == [{"shard": 0}]
    assert lease.output_prefix == f"out/t1/{lease.token}"
    assert lease.last_write == 100.0 and not lease.lost
    assert claim(store, clock, "t2", sent_at=42.0).last_write == 42.0  # an observer's TTL may have started then


def test_a_heartbeat_commits_records_under_the_previous_generation_and_stamps_when_it_was_sent(tmp_path):
    store, clock = LocalStore(tmp_path / "q"), SetClock()
    lease = claim(store, clock)
    token, first = lease.token, lease.generation
    clock.now += 12.0
    lease.heartbeat([{"shard": 0}])
    assert lease.generation > first and lease.token == token
    body, metadata = stored(store, "leases/t1.json")
    assert body["progress"] == [{"shard": 0}] and body["heartbeat_at"] == iso(12) and body["state"] == HELD
    assert metadata == {"state": "held", "worker": "w1", "ttl_s": "30.0", "heartbeat_at": iso(12)}
    assert lease.last_write == 112.0 and lease.body == body
    clock.now += 5.0
    lease.heartbeat()
    assert stored(store, "leases/t1.json")[0]["progress"] == [{"shard": 0}]  # kept, not committed twice


def test_a_write_seen_by_another_loses_the_lease_and_every_later_write_is_refused_without_a_request(tmp_path):
    store, clock = LocalStore(tmp_path / "q"), SetClock()
    lease = claim(store, clock)
    taker = new_lease_body("t1", "w2", 30.0, clock, lease.body)
    store.write("leases/t1.json", encode(taker)[0], if_generation=lease.generation)
    taken_at = store.read("leases/t1.json").generation
    with pytest.raises(LeaseLost, match=rf"^lease on task t1 is no longer at generation {lease.generation}: "):
        lease.heartbeat()
    assert lease.lost
    for write in (lease.heartbeat, lease.release, lambda: lease.complete([], 100.0), lambda: lease.dead_letter("r")):
        with pytest.raises(LeaseLost, match="^lease on task t1 was already lost$"):
            write()
    assert store.read("leases/t1.json").generation == taken_at
    assert not list(store.list("done/")) and not list(store.list("failed/"))


def test_a_lease_deleted_under_its_holder_is_lost(tmp_path):
    store, clock = LocalStore(tmp_path / "q"), SetClock()
    lease = claim(store, clock)
    store.delete("leases/t1.json")
    with pytest.raises(LeaseLost):
        lease.release()
    assert lease.lost


def test_a_release_gives_the_task_back_with_its_records_and_the_error_of_the_attempt(tmp_path):
    store, clock = LocalStore(tmp_path / "q"), SetClock()
    lease = claim(store, clock, previous={"state": RELEASED, "errors": [{"e": 1}]})
    clock.now += 3.0
    lease.release([{"shard": 1}], error={"e": 2})
    body, metadata = stored(store, "leases/t1.json")
    assert (body["state"], body["errors"], body["progress"], body["heartbeat_at"]) == (RELEASED, [{"e": 1}, {"e": 2}], [{"shard": 1}], iso(3))
    assert metadata["state"] == "released"
    lease2 = claim(store, clock, "t2")
    lease2.release()
    assert stored(store, "leases/t2.json")[0]["errors"] == []


def test_completion_writes_the_done_tombstone_then_its_marker_with_counters_token_and_seconds(tmp_path):
    store, clock = LocalStore(tmp_path / "q"), SetClock()
    lease = claim(store, clock)
    lease.heartbeat([{"shard": 0, "counters": {"rows": 2}}])
    clock.now += 7.12345
    assert lease.complete([{"shard": 1, "counters": {"rows": 3}}], started_mono=100.0) is True
    tombstone, metadata = stored(store, "leases/t1.json")
    assert tombstone["state"] == DONE and tombstone["fencing_token"] == lease.token
    assert tombstone["counters"] == {"rows": 5} and tombstone["seconds"] == 7.123
    assert tombstone["completed_at"] == iso(7.12345) and tombstone["progress"] == [{"shard": 0, "counters": {"rows": 2}},
                                                                                  {"shard": 1, "counters": {"rows": 3}}]  # fmt: skip
    assert metadata == {"state": "done", "worker": "w1", "ttl_s": "30.0", "heartbeat_at": iso(7.12345), "counters": '{"rows":5}'}
    marker, marker_metadata = stored(store, "done/t1.json")
    assert marker == json.loads(marker_of(tombstone)[1]) and marker["fencing_token"] == lease.token
    assert marker_metadata == {"completed_at": iso(7.12345), "seconds": "7.123", "counters": '{"rows":5}'}
    assert not list(store.list("failed/"))


def test_a_tombstone_leaves_out_empty_fields_and_is_final(tmp_path):
    store, clock = LocalStore(tmp_path / "q"), SetClock()
    lease = claim(store, clock)
    lease.complete([], started_mono=100.0)  # no counters, no time: neither is written as an empty value
    tombstone = stored(store, "leases/t1.json")[0]
    assert "counters" not in tombstone and "seconds" not in tombstone and tombstone["state"] == DONE
    generation = lease.generation
    for write in (lease.heartbeat, lease.release, lambda: lease.dead_letter("late")):
        with pytest.raises(LeaseLost, match="^lease on task t1 is already done$"):
            write()
    assert store.read("leases/t1.json").generation == generation and not lease.lost


def test_a_dead_letter_writes_the_dead_tombstone_then_the_letter_with_the_reason_and_the_last_error(tmp_path):
    store, clock = LocalStore(tmp_path / "q"), SetClock()
    lease = claim(store, clock, previous={"state": RELEASED, "errors": [{"e": 1}]})
    clock.now += 4.0
    lease.dead_letter("bad input: field x", [{"shard": 0}], error={"e": 2})
    tombstone, metadata = stored(store, "leases/t1.json")
    assert (tombstone["state"], tombstone["reason"], tombstone["errors"]) == (DEAD, "bad input: field x", [{"e": 1}, {"e": 2}])
    assert tombstone["fencing_token"] == lease.token and tombstone["failed_at"] == iso(4)
    assert tombstone["progress"] == [{"shard": 0}] and metadata["state"] == "dead"
    letter, letter_metadata = stored(store, "failed/t1.json")
    assert letter == {"task": "t1", "reason": "bad input: field x", "errors": [{"e": 1}, {"e": 2}], "worker": "w1",
                      "fencing_token": lease.token, "failed_at": iso(4)}  # fmt: skip
    assert letter_metadata == {"reason": "bad input: field x"}
    with pytest.raises(LeaseLost, match="^lease on task t1 is already dead$"):
        lease.heartbeat()
    other = claim(store, clock, "t2")
    other.dead_letter("gave up")
    assert stored(store, "leases/t2.json")[0]["errors"] == []


def test_a_marker_a_sweep_copied_first_is_the_same_and_the_completion_is_still_ours(tmp_path, caplog):
    store, clock = LocalStore(tmp_path / "q"), SetClock()
    lease = claim(store, clock)
    store.create("done/t1.json", b"copied")
    with caplog.at_level(logging.INFO, logger="taskqueue.lease"):
        assert lease.complete([], started_mono=100.0) is True
    assert "event=marker_exists task=t1 object=done/t1.json copied_by=sweep" in caplog.messages
    assert store.read("done/t1.json").data == b"copied"


def test_a_lease_taken_before_completion_writes_no_tombstone_and_no_marker(tmp_path):
    store, clock = LocalStore(tmp_path / "q"), SetClock()
    lease = claim(store, clock)
    store.write("leases/t1.json", b"{}", if_generation=lease.generation)
    with pytest.raises(LeaseLost):
        lease.complete([], started_mono=100.0)
    with pytest.raises(LeaseLost):
        lease.dead_letter("r")
    assert not list(store.list("done/")) and not list(store.list("failed/"))


def test_settling_on_an_existing_marker_writes_its_tombstone_with_its_counters(tmp_path, caplog):
    store, clock = LocalStore(tmp_path / "q"), SetClock()
    lease = claim(store, clock)
    lease.settle(DONE, {"rows": 3})
    tombstone, metadata = stored(store, "leases/t1.json")
    assert tombstone["state"] == DONE and tombstone["counters"] == {"rows": 3} and metadata["counters"] == '{"rows":3}'
    assert not list(store.list("done/"))  # the marker was there already: settle makes none
    dead = claim(store, clock, "t2")
    dead.settle(DEAD)
    assert stored(store, "leases/t2.json")[0]["state"] == DEAD and "counters" not in stored(store, "leases/t2.json")[0]
    taken = claim(store, clock, "t3")
    store.write("leases/t3.json", b"{}", if_generation=taken.generation)
    with caplog.at_level(logging.WARNING, logger="taskqueue.lease"):
        taken.settle(DONE)  # refused, and said; never raised
    assert [m for m in caplog.messages if m.startswith("event=tombstone_refused task=t3 state=done error=lease on task t3 ")]


class GappedStore(LocalStore):
    same_object_write_gap_s = 1.0


def test_a_tombstone_waits_out_the_rest_of_the_second_since_its_last_write_was_answered(tmp_path):
    store, clock = GappedStore(tmp_path / "q"), SetClock()
    lease = claim(store, clock)
    clock.now += 0.25
    lease.heartbeat()
    clock.now += 0.5
    lease.complete([], started_mono=100.0)
    assert clock.waits == [pytest.approx(0.5)]
    lease = claim(store, clock, "t2")
    clock.now += 1.0  # a second already passed: no wait
    lease.dead_letter("r")
    assert clock.waits == [pytest.approx(0.5)]
    lease = claim(store, clock, "t3")
    lease.settle(DONE)
    assert clock.waits == [pytest.approx(0.5), pytest.approx(1.0)]


def test_a_tombstone_on_a_store_without_a_write_gap_never_waits(tmp_path):
    store, clock = LocalStore(tmp_path / "q"), SetClock()
    claim(store, clock).complete([], started_mono=100.0)
    assert clock.waits == []


def test_tombstones_are_the_finished_states():
    assert set(FINISHED) == {DONE, DEAD} and HELD not in FINISHED and RELEASED not in FINISHED
    assert (HELD, RELEASED, DEAD, DONE) == ("held", "released", "dead", "done")

