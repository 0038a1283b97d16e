"""taskqueue.claims on its own: what a worker claims, how it takes over a lease, where it walks, when it
waits and when it leaves (docs/PROTOCOL.md, "Claim").

In-process, on a local store and a clock the test sets, so that mutation testing (`make mutants`)
reaches every branch of the Claimer in a second or two per mutant. Where another worker must write
between two of the Claimer's requests, or a request must fail, a hook of the store does it
(`Hooked`); time moves only when the Claimer waits (`SetClock`)."""

from __future__ import annotations

import json
import logging

import pytest

from objectstore import StoreError, StoreUnavailable
from objectstore.base import MAX_LIST_PAGE
from objectstore.local import LocalStore
from taskqueue import layout
from taskqueue.claims import Claimer, ClaimOptions, default_poll_max
from taskqueue.lease import DEAD, DONE, HELD, RELEASED, LeaseLost, encode, new_lease_body
from tests.queue.test_lease import SetClock


class Hooked(LocalStore):
    """A local store that logs every request of the code under test, with the test's clock, and runs
    the test's hooks before it: another worker's write between two of ours, or a failure. Hooks
    and the test's own setup go through `plain`, the same queue unlogged and unhooked."""

    def __init__(self, path, clock: SetClock):
        super().__init__(path)
        self.plain = LocalStore(path)
        self.clock = clock
        self.hooks: list = []
        self.requests: list[tuple[str, str, float]] = []  # (operation, name or prefix + offset, when)
        self.pages: list[tuple[str, int]] = []  # (prefix + offset, page size) of each listing
        self.splits_page = MAX_LIST_PAGE

    def _hook(self, op: str, name: str) -> None:
        self.requests.append((op, name, self.clock.now))
        for hook in list(self.hooks):
            hook(op, name)

    def read(self, name):
        self._hook("read", name)
        return super().read(name)

    def create(self, name, data, metadata=None):
        self._hook("create", name)
        return super().create(name, data, metadata)

    def write(self, name, data, if_generation, metadata=None):
        self._hook("write", name)
        return super().write(name, data, if_generation, metadata)

    def delete(self, name, if_generation=None):
        self._hook("delete", name)
        return super().delete(name, if_generation)

    def list_page(self, prefix, page_token=None, start_offset=None, page_size=MAX_LIST_PAGE, end_offset=None):
        self._hook("list", prefix + (start_offset or "")[len(prefix):])
        self.pages.append((start_offset or prefix, page_size))
        if prefix == layout.SPLITS:
            page_size = min(page_size, self.splits_page)  # a map of many pages without a thousand regions
        return super().list_page(prefix, page_token, start_offset, page_size, end_offset)

    def count(self, op: str, name: str) -> int:
        return sum(1 for o, n, _ in self.requests if o == op and n == name)


def queue(tmp_path, ids, splits=(), manifests=True) -> tuple[Hooked, SetClock]:
    clock = SetClock()
    store = Hooked(tmp_path / "q", clock)
    for task_id in ids:
        manifest = json.dumps({"id": task_id})
        store.plain.create(layout.task_object(task_id), manifest.encode(),
                          {"manifest": manifest} if manifests else None)  # fmt: skip
    for task_id in splits:
        store.plain.create(layout.split_object(task_id), b"{}")
    return store, clock


def list_of(store, prefix):
    return list(store.plain.list(prefix))


def claimer(store, clock, seed=1, **options) -> Claimer:
    options = {"worker": "w1", "lease_ttl_s": 30.0, "idle_timeout_s": 60.0, "poll_min_s": 1.0, "poll_max_s": 8.0, **options}
    return Claimer(store, ClaimOptions(seed=seed, **options), clock)


def lease(store, task_id, state=HELD, worker="w0", ttl_s=30.0, **fields) -> int:
    """Another worker's lease, as its last write left it."""
    data, metadata = encode({**new_lease_body(task_id, worker, ttl_s, SetClock()), "state": state, **fields})
    return store.plain.create(layout.lease_object(task_id), data, metadata)


def rewrite(store, task_id, **changes) -> int:
    """Another worker's write of a lease at its current generation (a heartbeat, a takeover, a tombstone)."""
    current = store.plain.read(layout.lease_object(task_id))
    data, metadata = encode({**json.loads(current.data), **changes})
    return store.plain.write(layout.lease_object(task_id), data, current.generation, metadata)


def stored(store, task_id) -> dict:
    return json.loads(store.plain.read(layout.lease_object(task_id)).data)


def run_all(claims: Claimer, clock, limit=50) -> list[str]:
    """Claim and complete everything the Claimer yields; the ids in claim order."""
    ran = []
    for claim in claims:
        ran.append(claim.task_id)
        claim.lease.complete([], clock.now)
        assert len(ran) <= limit, f"claimed {ran}"
    return ran


def renewing(store, worker="w0"):
    """A hook: the live holder `worker` renews its held leases before every listing of leases/."""

    def hook(op, name):
        if op == "list" and name.startswith(layout.LEASES):
            for entry in store.plain.list(layout.LEASES):
                if entry.metadata.get("worker") == worker and entry.metadata.get("state") == HELD:
                    rewrite(store, layout.id_from_object(entry.name, layout.LEASES), heartbeat_at=str(store.clock.now))

    return hook


def at_the_last_look(clock, act) -> tuple:
    """A hook that calls `act()` once, just before the last look lists batches/ (the second listing of
    batches/ at one instant, from 120 s on), and the list its answer is appended to."""
    listed, answers = [], []

    def hook(op, name):
        if op == "list" and name == layout.BATCHES:
            if clock.now >= 120.0 and listed and listed[-1] == clock.now and not answers:
                answers.append(act())
            listed.append(clock.now)

    return hook, answers


def created_first(store, task_id):
    """A hook: another live worker creates `task_id`'s lease just before this one's create."""

    def hook(op, name):
        if op == "create" and name == layout.lease_object(task_id) and not list_of(store, name):
            lease(store, task_id, HELD)

    return hook


def failing(op, name, error, times=1):
    """A hook: the next `times` requests `op` on `name` fail with `error`."""
    left = [times]

    def hook(o, n):
        if o == op and n == name and left[0] > 0:
            left[0] -= 1
            raise error

    return hook


def ids_of(prefix, n) -> list[str]:
    return [f"{prefix}{k:02d}" for k in range(n)]


# -- claiming -------------------------------------------------------------------------------------


def test_a_worker_claims_every_task_once_then_leaves_drained_with_every_region_swept(tmp_path, caplog):
    store, clock = queue(tmp_path, ["a1", "a2", "a3", "b1", "b2"], splits=["b1"])
    claims = claimer(store, clock)
    seen = []
    with caplog.at_level(logging.INFO, logger="taskqueue.claims"):
        for claim in claims:
            assert claim.manifest == {"id": claim.task_id} and claim.problem is None
            seen.append(claim.task_id)
            claim.lease.complete([], clock.now)
    assert sorted(seen) == ["a1", "a2", "a3", "b1", "b2"]
    assert claims.exit_reason == "drained" and caplog.messages[-1] == "event=queue_drained regions=2"
    assert {e.name for e in list_of(store, layout.SWEPT)} == {"swept/-.json", "swept/b1.json"}
    assert not any(op == "read" and name.startswith(layout.TASKS) for op, name, _ in store.requests)  # from the listing
    creates = [name for op, name, _ in store.requests if op == "create" and name.startswith(layout.LEASES)]
    assert sorted(creates) == sorted(set(creates)) and len(creates) == 5  # a task it finished is never claimed again


def test_a_first_claim_creates_the_lease_whose_generation_is_its_token(tmp_path, caplog):
    store, clock = queue(tmp_path, ["a1"])
    with caplog.at_level(logging.INFO, logger="taskqueue.claims"):
        claim = next(iter(claimer(store, clock, lease_ttl_s=45.0)))
    current = store.plain.read(layout.lease_object("a1"))
    assert claim.lease.generation == claim.lease.token == current.generation
    body = json.loads(current.data)
    assert (body["state"], body["worker"], body["ttl_s"], body["attempt"], body["takeovers"]) == (HELD, "w1", 45.0, 1, 0)
    assert f"event=claimed task=a1 token={current.generation} attempt=1" in caplog.messages
    assert claim.lease.last_write == 100.0


def test_a_released_lease_is_taken_over_at_once_with_its_errors_and_progress(tmp_path, caplog):
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", RELEASED, errors=[{"attempt": 1, "exit_code": 1}], progress=[{"shard": 0}], attempt=2)
    with caplog.at_level(logging.INFO, logger="taskqueue.claims"):
        claim = next(iter(claimer(store, clock)))
    body = stored(store, "a1")
    assert (claim.task_id, body["state"], body["worker"], body["attempt"], body["takeovers"]) == ("a1", HELD, "w1", 2, 0)
    assert body["errors"] == [{"attempt": 1, "exit_code": 1}] and body["progress"] == [{"shard": 0}]
    assert clock.waits == [] and store.count("create", layout.lease_object("a1")) == 0
    assert f"event=takeover task=a1 token={claim.lease.token} attempt=2 previous_worker=w0 committed=1" in caplog.messages


@pytest.mark.parametrize("before", [None, RELEASED])
def test_a_claims_lease_runs_from_when_its_write_was_sent_and_its_listing_names_its_holder(tmp_path, before):
    """A create (no lease before) or a takeover's write whose answer takes 5 s: the lease is live
    until a TTL after the write was sent, not after the answer came; and its listing carries the
    state, holder and TTL that other workers' views read (they never read the body)."""
    store, clock = queue(tmp_path, ["a1"])
    if before:
        lease(store, "a1", before)

    def answered_5_s_later(op, name):
        if op in ("create", "write") and name == layout.lease_object("a1"):
            clock.now += 5.0

    store.hooks.append(answered_5_s_later)
    claim = next(iter(claimer(store, clock, lease_ttl_s=45.0)))
    sent = [t for op, name, t in store.requests if op in ("create", "write") and name == layout.lease_object("a1")]
    assert claim.lease.last_write == sent[0] and clock.now == sent[0] + 5.0
    (entry,) = list_of(store, layout.LEASES)
    assert (entry.metadata["state"], entry.metadata["worker"], entry.metadata["ttl_s"]) == (HELD, "w1", "45.0")


def test_the_done_check_of_a_takeover_is_one_page_of_done_markers_from_the_task_on_and_one_dead_letter(tmp_path):
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", RELEASED)
    claim = next(iter(claimer(store, clock)))
    assert claim.task_id == "a1"
    checks = [page for page in store.pages if page[0].startswith((layout.DONE, layout.FAILED))]
    assert checks == [("done/a1.json", 64), ("failed/a1.json", 1)]


def test_a_held_lease_is_stolen_only_once_watched_unchanged_for_its_ttl(tmp_path, caplog):
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", HELD, ttl_s=30.0)
    with caplog.at_level(logging.INFO, logger="taskqueue.claims"):
        claim = next(iter(claimer(store, clock, idle_timeout_s=5.0)))
    assert claim.task_id == "a1" and claim.lease.body["takeovers"] == 1 and claim.lease.body["worker"] == "w1"
    writes = [t for op, name, t in store.requests if op == "write" and name == layout.lease_object("a1")]
    assert writes and writes[0] >= 130.0 and clock.now < 130.0 + 8.0  # within a poll of the expiry
    assert any(m.startswith("event=steal task=a1 ") and "previous_worker=w0" in m for m in caplog.messages)


def test_a_takeover_beside_a_marker_an_older_version_wrote_settles_it_and_learns_the_markers_ahead(tmp_path, caplog):
    """An older version wrote the marker first and the tombstone after; its holders died in between:
    a03 released beside its done marker, a04 beside its dead letter, a21 and a22 held beside their
    done markers. a03 and a04 are settled as tombstones, never run; a20's takeover (no marker) lists
    the done markers ahead of it, so a21 and a22 are never taken over, even once their TTL is past."""
    ids = ids_of("a", 24)
    store, clock = queue(tmp_path, ids)
    for task_id in ("a03", "a04", "a05", "a20"):
        lease(store, task_id, RELEASED)
    for task_id in ("a21", "a22"):
        lease(store, task_id, HELD, ttl_s=30.0)
        store.plain.create(layout.done_object(task_id), b"{}")
    store.plain.create(layout.done_object("a03"), b"{}", {"counters": '{"rows":3}'})
    store.plain.create(layout.failed_object("a04"), b"{}")
    store.plain.create(layout.done_object("a05"), b"{}")  # a task that counted nothing
    claims = claimer(store, clock, seed=2)
    with caplog.at_level(logging.INFO, logger="taskqueue.claims"):
        ran = run_all(claims, clock)
    assert sorted(ran) == sorted(set(ids) - {"a03", "a04", "a05", "a21", "a22"}) and claims.exit_reason == "drained"
    a03 = stored(store, "a03")
    assert (a03["state"], a03["worker"], a03.get("counters")) == (DONE, "w1", {"rows": 3})
    assert (stored(store, "a04")["state"], stored(store, "a04")["worker"]) == (DEAD, "w1")
    assert (stored(store, "a05")["state"], "counters" in stored(store, "a05")) == (DONE, False)
    assert [(stored(store, t)["state"], stored(store, t)["worker"]) for t in ("a21", "a22")] == [(HELD, "w0")] * 2
    assert "event=tombstone task=a03 state=done previous_worker=w0" in caplog.messages
    assert "event=tombstone task=a04 state=dead previous_worker=w0" in caplog.messages


def test_a_task_a_takeover_settled_is_not_read_again_when_the_listing_after_it_fails(tmp_path):
    """a1 was released beside its dead letter (an older version's order): the takeover settles it
    as a tombstone. The listing of leases just after fails once (a 503): the worker knows a1 is
    finished from its own write, and does not read a1's lease again when it tries once more (the
    done check's listing of done/ tells a done task apart by itself; only a dead letter needs this)."""
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", RELEASED)
    store.plain.create(layout.failed_object("a1"), b"{}")
    failed = []

    def the_listing_after_the_settle_fails(op, name):
        if op == "list" and name.startswith(layout.LEASES) and store.count("write", layout.lease_object("a1")) == 2:
            if not failed:
                failed.append(clock.now)
                raise StoreUnavailable("leases/: 503")

    store.hooks.append(the_listing_after_the_settle_fails)
    claims = claimer(store, clock)
    assert list(claims) == [] and claims.exit_reason == "drained" and failed
    assert stored(store, "a1")["state"] == DEAD and store.count("read", layout.lease_object("a1")) == 1


def test_a_done_check_that_fails_gives_the_lease_back_and_raises(tmp_path):
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", RELEASED)
    store.hooks.append(failing("list", "done/a1.json", StoreError("done/: refused")))
    with pytest.raises(StoreError, match="refused"):
        next(iter(claimer(store, clock)))
    assert (stored(store, "a1")["state"], stored(store, "a1")["worker"]) == (RELEASED, "w1")


def test_a_give_back_that_fails_too_is_logged_and_the_done_checks_error_raised(tmp_path, caplog):
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", RELEASED)
    store.hooks.append(failing("list", "done/a1.json", StoreError("done/: refused")))
    writes = [0]

    def second_write_fails(op, name):
        if op == "write" and name == layout.lease_object("a1"):
            writes[0] += 1
            if writes[0] == 2:
                raise StoreError("leases/: refused")

    store.hooks.append(second_write_fails)
    with caplog.at_level(logging.WARNING, logger="taskqueue.claims"), pytest.raises(StoreError, match="done/: refused"):
        next(iter(claimer(store, clock)))
    assert "event=release_failed task=a1" in caplog.messages
    assert (stored(store, "a1")["state"], stored(store, "a1")["worker"]) == (HELD, "w1")  # it expires after its TTL


def test_a_lease_renewed_between_its_listing_and_the_read_is_watched_a_whole_ttl_again(tmp_path):
    """The dead-looking holder renewed once more just before the steal's read, then died: the worker
    must watch that new generation for a whole TTL, and must not leave idle meanwhile."""
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", HELD, ttl_s=30.0)
    renewed = []

    def renew_before_the_first_read(op, name):
        if op == "read" and name == layout.lease_object("a1") and not renewed:
            renewed.append((rewrite(store, "a1", heartbeat_at="late"), clock.now))

    store.hooks.append(renew_before_the_first_read)
    claim = next(iter(claimer(store, clock, idle_timeout_s=5.0)))
    (generation, at), = renewed
    assert at >= 130.0
    writes = [t for op, name, t in store.requests if op == "write" and name == layout.lease_object("a1")]
    assert writes[0] >= at + 30.0 and claim.lease.body["takeovers"] == 1
    assert claim.lease.token > generation


def test_a_released_lease_taken_over_by_another_before_the_read_is_watched_a_whole_ttl(tmp_path):
    """a1's holder renews it and releases it while this worker runs a2: changes seen within a TTL,
    a renewal. Just before this worker's read for its takeover, w9 takes a1 over and dies. That
    generation was never seen renewing: the worker watches it a whole TTL and steals it, rather
    than leave `idle` beside it as if its holder were alive."""
    store, clock = queue(tmp_path, ["a1", "a2"])
    lease(store, "a1", HELD)
    claims = claimer(store, clock, idle_timeout_s=5.0)
    walk = iter(claims)
    first = next(walk)
    assert first.task_id == "a2"
    rewrite(store, "a1", state=RELEASED)
    first.lease.complete([], clock.now)
    taken = []

    def taken_over_before_the_read(op, name):
        if op == "read" and name == layout.lease_object("a1") and not taken:
            taken.append(clock.now)
            rewrite(store, "a1", state=HELD, worker="w9")

    store.hooks.append(taken_over_before_the_read)
    second = next(walk, None)
    assert taken and second is not None and second.task_id == "a1", claims.exit_reason
    assert second.lease.body["takeovers"] == 1 and clock.now >= taken[0] + 30.0


def test_a_lease_gone_before_the_read_is_created_afresh(tmp_path):
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", RELEASED)
    gone = []

    def delete_before_the_read(op, name):
        if op == "read" and name == layout.lease_object("a1") and not gone:
            gone.append(store.plain.delete(name))

    store.hooks.append(delete_before_the_read)
    claim = next(iter(claimer(store, clock)))
    assert claim.task_id == "a1" and claim.lease.body["attempt"] == 1 and clock.waits == []
    assert store.count("create", layout.lease_object("a1")) == 1 and store.count("read", layout.lease_object("a1")) == 1


def test_a_lease_finished_between_its_listing_and_the_read_is_never_written(tmp_path):
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", RELEASED)
    store.hooks.append(lambda op, name: op == "read" and stored(store, "a1")["state"] == RELEASED
                       and rewrite(store, "a1", state=DONE, worker="w0"))  # fmt: skip
    claims = claimer(store, clock)
    assert list(claims) == [] and claims.exit_reason == "drained"
    assert (stored(store, "a1")["state"], stored(store, "a1")["worker"]) == (DONE, "w0")
    assert store.count("write", layout.lease_object("a1")) == 0


def test_a_takeover_that_loses_the_race_claims_nothing(tmp_path):
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", RELEASED)
    store.hooks.append(lambda op, name: op == "write" and stored(store, "a1")["state"] == RELEASED
                       and rewrite(store, "a1", state=DONE, worker="w9"))  # fmt: skip
    claims = claimer(store, clock)
    assert list(claims) == [] and claims.exit_reason == "drained"
    assert (stored(store, "a1")["state"], stored(store, "a1")["worker"]) == (DONE, "w9")


def test_a_create_that_collides_leaves_the_task_to_its_holder_and_judges_it_before_leaving_idle(tmp_path, caplog):
    """Another worker created the lease between our listing and our create, then died: the worker
    claims the other task, never leaves idle beside the dead holder's lease (its placeholder is no
    renewal), and steals it once it has watched it unchanged for its TTL."""
    store, clock = queue(tmp_path, ["a1", "a2"])
    collided = []

    def create_first(op, name):
        if op == "create" and name.startswith(layout.LEASES) and not collided:
            collided.append((layout.id_from_object(name, layout.LEASES), clock.now))
            lease(store, collided[0][0], HELD, worker="w9", ttl_s=30.0)

    store.hooks.append(create_first)
    claims = claimer(store, clock, idle_timeout_s=5.0)
    with caplog.at_level(logging.DEBUG, logger="taskqueue.claims"):
        ran = run_all(claims, clock)
    (task_id, at), = collided
    assert f"event=claim_collision task={task_id}" in caplog.messages
    assert ran == [({"a1", "a2"} - {task_id}).pop(), task_id] and claims.exit_reason == "drained"
    writes = [t for op, name, t in store.requests if op == "write" and name == layout.lease_object(task_id)]
    assert writes[0] >= at + 30.0 and store.count("create", layout.lease_object(task_id)) == 1


# -- what a worker did itself --------------------------------------------------------------------


@pytest.mark.parametrize("taken, seed, region, low, high", [(30, 2, "b", 38, 52), (50, 1, "c", 5, 15)])
def test_after_a_collision_the_worker_re_lists_the_leases_and_lands_beyond_the_other_workers_run(
    tmp_path, taken, seed, region, low, high
):
    """Region b of sixty untouched tasks, region c of twenty (the head region's only task is held); just
    before the first create another worker takes b00 up to b{taken - 1}. The create collides; the worker
    re-lists b's leases (one request, no move). With thirty tasks left it lands around the middle of
    b30-b59 (45, give or take 30 // 4), with no second collision; with ten left, fewer than MIN_RUN, it
    moves on to region c and lands around its middle (10, give or take 20 // 4) instead."""
    ids = ids_of("b", 60)
    store, clock = queue(tmp_path, ["a1"] + ids + ids_of("c", 20), splits=["b00", "c00"])
    lease(store, "a1", HELD)
    held = []

    def another_worker_takes_the_first_tasks(op, name):
        if op == "create" and name.startswith(layout.LEASES) and not held:
            held.extend(lease(store, task_id, HELD) for task_id in ids[:taken])

    store.hooks.append(another_worker_takes_the_first_tasks)
    claim = next(iter(claimer(store, clock, seed=seed)))
    creates = [name for op, name, t in store.requests if op == "create" and name.startswith(layout.LEASES)]
    assert held and len(creates) == 2 and ids.index(creates[0][len(layout.LEASES):-5]) < taken, creates
    assert claim.task_id.startswith(region) and low <= int(claim.task_id[1:]) <= high, claim.task_id
    assert store.count("list", "leases/b00.json") == 2  # the start's load, and the one after the collision


def test_after_a_release_the_walk_goes_on_to_the_next_task(tmp_path):
    """A task given back (a failed attempt) is left behind: the next claim is the one after it, not
    the same task taken over at once."""
    store, clock = queue(tmp_path, ids_of("a", 10))
    walk = iter(claimer(store, clock, seed=4))
    first = next(walk)
    first.lease.release()
    second = next(walk)
    assert int(second.task_id[1:]) == int(first.task_id[1:]) + 1, (first.task_id, second.task_id)


def test_a_task_the_worker_released_itself_is_taken_over_not_created_again(tmp_path, caplog):
    store, clock = queue(tmp_path, ["a1"])
    claims = claimer(store, clock)
    walk = iter(claims)
    next(walk).lease.release(error={"attempt": 1, "exit_code": 1})
    with caplog.at_level(logging.INFO, logger="taskqueue.claims"):
        again = next(walk)
    assert again.task_id == "a1" and again.lease.body["attempt"] == 2 and clock.waits == []
    assert store.count("create", layout.lease_object("a1")) == 1 and store.count("read", layout.lease_object("a1")) == 1
    assert any(m.startswith("event=takeover task=a1 ") for m in caplog.messages)


def test_a_tombstone_whose_write_failed_leaves_the_task_held_until_a_ttl_after_that_write(tmp_path):
    """The `done` write went unanswered: the worker does not count the task finished, nor claim it
    again while its own last confirmed write is live; a TTL after that write it steals it back."""
    store, clock = queue(tmp_path, ["a1"])
    walk = iter(claimer(store, clock, idle_timeout_s=5.0))
    first = next(walk)
    clock.now += 10.0
    first.lease.heartbeat()  # its last confirmed write: sent at 110
    store.hooks.append(failing("write", layout.lease_object("a1"), StoreUnavailable("leases/a1.json: no answer")))
    with pytest.raises(StoreUnavailable):
        first.lease.complete([], clock.now)
    again = next(walk)
    writes = [t for op, name, t in store.requests if op == "write" and name == layout.lease_object("a1")]
    assert again.task_id == "a1" and writes[-1] >= 140.0 and again.lease.body["takeovers"] == 1


def test_a_move_skips_a_region_whose_only_open_task_is_the_workers_own_unconfirmed_lease(tmp_path):
    """Regions a (a0) and b (b0, b1). The `done` write of a0 goes unanswered: a0 stays held by this
    worker in its view, live until a TTL after its last confirmed write. The worker runs b, and its
    move after b does not list a's leases again for a task it knows is its own and live; a is listed
    again by the poll after the first wait, and not before."""
    store, clock = queue(tmp_path, ["a0", "b0", "b1"], splits=["b0"])
    claims = claimer(store, clock, seed=0)
    store.hooks.insert(0, lambda op, name: clock.waits and claims.stop())
    walk = iter(claims)
    first = next(walk)
    assert first.task_id == "a0"
    store.hooks.append(failing("write", layout.lease_object("a0"), StoreUnavailable("leases/a0.json: no answer")))
    with pytest.raises(StoreUnavailable):
        first.lease.complete([], clock.now)
    assert sorted(run_all(walk, clock)) == ["b0", "b1"] and claims.exit_reason == "stopped"
    listed = [name for op, name, t in store.requests if op == "list"]
    assert listed.count("leases/") == 2 and listed[-2:] == [layout.BATCHES, "leases/"], listed  # the start's, the poll's


def test_a_task_the_worker_lost_is_its_thiefs(tmp_path):
    store, clock = queue(tmp_path, ["a1", "a2"])
    walk = iter(claimer(store, clock, seed=3))
    first = next(walk)
    rewrite(store, first.task_id, worker="thief")  # stolen while this worker was frozen
    with pytest.raises(LeaseLost):
        first.lease.heartbeat()
    rest = next(walk)
    assert rest.task_id != first.task_id
    rest.lease.complete([], clock.now)
    rewrite(store, first.task_id, state=DONE)  # the thief finishes it
    assert list(walk) == []


# -- manifests ------------------------------------------------------------------------------------


def test_a_manifest_rides_in_the_listing_or_is_read_and_a_bad_one_is_a_problem_named_not_an_error(tmp_path):
    store, clock = queue(tmp_path, [], manifests=False)
    plain = LocalStore(tmp_path / "q")
    plain.create(layout.task_object("m1"), json.dumps({"id": "m1", "n": 1}).encode())  # no copy in the listing
    plain.create(layout.task_object("m2"), b"{not json")
    plain.create(layout.task_object("m3"), json.dumps({"id": "m3", "pad": "x" * layout.MAX_MANIFEST_BYTES}).encode())
    plain.create(layout.task_object("m4"), json.dumps({"id": "m4"}).encode())
    store.hooks.append(lambda op, name: op == "read" and name == layout.task_object("m4") and plain.delete(name))
    claims = {}
    for claim in claimer(store, clock):
        claims[claim.task_id] = claim
        claim.lease.complete([], clock.now)
    assert claims["m1"].manifest == {"id": "m1", "n": 1} and claims["m1"].problem is None
    assert claims["m2"].manifest is None and claims["m2"].problem.startswith(store.url("tasks/m2.json") + ": ")
    size = len(json.dumps({"id": "m3", "pad": "x" * layout.MAX_MANIFEST_BYTES}))
    assert claims["m3"].problem == f"{store.url('tasks/m3.json')}: manifest is {size} bytes, over the 65536-byte limit"
    assert claims["m4"].problem == f"{store.url('tasks/m4.json')}: manifest object is missing"
    assert store.count("read", layout.task_object("m3")) == 0  # too big: known from the listing's size
    assert all(claims[t].lease.body["state"] == DONE for t in claims)


def test_a_manifest_that_cannot_be_read_now_gives_the_task_back(tmp_path):
    store, clock = queue(tmp_path, ["m1"], manifests=False)
    store.hooks.append(failing("read", layout.task_object("m1"), StoreError("tasks/m1.json: refused")))
    with pytest.raises(StoreError, match="refused"):
        next(iter(claimer(store, clock)))
    assert (stored(store, "m1")["state"], stored(store, "m1")["worker"]) == (RELEASED, "w1")


def test_a_manifest_of_exactly_the_limit_is_read(tmp_path):
    store, clock = queue(tmp_path, [], manifests=False)
    text = json.dumps({"id": "m1", "pad": ""})
    text = json.dumps({"id": "m1", "pad": "x" * (layout.MAX_MANIFEST_BYTES - len(text))})
    assert len(text) == layout.MAX_MANIFEST_BYTES
    store.plain.create(layout.task_object("m1"), text.encode())
    claim = next(iter(claimer(store, clock)))
    assert claim.problem is None and claim.manifest["id"] == "m1"


# -- where a worker walks -------------------------------------------------------------------------


def first_claims(tmp_path, ids, prepare, seeds) -> list[int]:
    """The index of each seed's first claim in a fresh copy of the queue."""
    store, clock = queue(tmp_path, ids)
    prepare(store)
    found = []
    for seed in seeds:
        task_id = next(iter(claimer(store, clock, seed=seed))).task_id
        found.append(ids.index(task_id))
        store.plain.delete(layout.lease_object(task_id))  # the queue as it was, for the next seed
    return found


def test_workers_starting_in_an_untouched_region_start_anywhere_in_it(tmp_path):
    found = first_claims(tmp_path, ids_of("a", 20), lambda store: None, range(25))
    assert min(found) <= 2 and max(found) >= 17 and len(set(found)) >= 12


def test_otherwise_a_worker_lands_near_the_middle_of_the_longest_run_of_claimable_tasks(tmp_path):
    ids = ids_of("a", 40)

    def tombstones_at_5_and_30(store):  # runs: 0-4, 6-29 (24 tasks), 31-39
        lease(store, "a05", DONE)
        lease(store, "a30", DONE)

    found = first_claims(tmp_path, ids, tombstones_at_5_and_30, range(30))
    assert min(found) == 12 and max(found) == 24  # 6 + 24 // 2, give or take 24 // 4


def test_of_two_runs_as_long_the_first_is_taken(tmp_path):
    ids = ids_of("a", 21)
    found = first_claims(tmp_path, ids, lambda store: lease(store, "a10", DONE), range(20))  # runs 0-9 and 11-20
    assert min(found) == 3 and max(found) == 7


def test_a_lone_claimable_task_between_held_ones_is_claimed_where_the_start_landed(tmp_path):
    """a0 and a2 are held, a1 is free: a run of one. The start lands on it and claims it, with the
    start's one listing of the leases (no re-listing, no move)."""
    store, clock = queue(tmp_path, ["a0", "a1", "a2"])
    lease(store, "a0", HELD)
    lease(store, "a2", HELD)
    claim = next(iter(claimer(store, clock)))
    assert claim.task_id == "a1" and store.count("list", layout.LEASES) == 1, store.requests


def test_a_worker_walks_forward_claiming_the_next_task_each_time(tmp_path):
    store, clock = queue(tmp_path, ids_of("a", 30))
    walk = iter(claimer(store, clock, seed=4))
    ran = []
    for claim in walk:
        ran.append(int(claim.task_id[1:]))
        claim.lease.complete([], clock.now)
        if len(ran) == 5:
            break
    assert ran == list(range(ran[0], ran[0] + 5)) and ran[0] <= 25


def test_past_a_stretch_someone_else_holds_the_walk_lands_in_the_middle_of_the_run_beyond(tmp_path):
    """a20 is held (live): the worker lands in 0-19, walks to a19, then goes to the middle of 21-39,
    not to a21 just behind the holder."""
    ids = ids_of("a", 40)
    store, clock = queue(tmp_path, ids)
    lease(store, "a20", HELD)
    walk = iter(claimer(store, clock, seed=5))
    ran = []
    for claim in walk:
        ran.append(ids.index(claim.task_id))
        claim.lease.complete([], clock.now)
        if ran[-1] == 19 or len(ran) > 30:
            break
    assert 5 <= ran[0] <= 15 and ran == list(range(ran[0], 20))
    assert 26 <= ids.index(next(walk).task_id) <= 34


@pytest.mark.parametrize("beyond, stays", [(16, True), (15, False)])
def test_past_a_held_stretch_a_run_shorter_than_min_run_is_left_for_another_region(tmp_path, beyond, stays):
    """Region a: a00-a19 free, a20 held, then `beyond` free tasks; region b: ten free tasks."""
    ids = ids_of("a", 21 + beyond)
    store, clock = queue(tmp_path, ids + ids_of("b", 10), splits=["b00"])
    lease(store, "a20", HELD)
    walk = iter(claimer(store, clock, seed=1))
    ran = []
    for claim in walk:
        ran.append(claim.task_id)
        claim.lease.complete([], clock.now)
        if "a19" in ran or len(ran) > 40:
            break
    ran_a = [t for t in ran if t.startswith("a")]
    assert ran_a == ids[ids.index(ran_a[0]):20], ran  # it walked in a up to the held task
    nxt = next(walk).task_id
    assert nxt.startswith("a") == stays, nxt
    assert not any(op == "list" and name.startswith(layout.DONE) for op, name, t in store.requests)  # nor a sweep tried in a


def test_a_walk_goes_on_past_its_own_trail_without_a_move(tmp_path):
    """Region a of thirty tasks, a25 held. The worker lands in a00-a24 and walks to a24; its holder
    releases a25 then. Past it (a26) the worker re-lists, and lands in the run before its trail. At
    that run's end the next claimable task, a25, lies beyond the worker's own done tasks only: it
    walks on to it, with no listing of tasks or leases and no move, though tasks behind the run are
    still unclaimed (the takeover's done check lists done/ and failed/)."""
    ids = ids_of("a", 30)
    store, clock = queue(tmp_path, ids)
    lease(store, "a25", HELD)
    walk = iter(claimer(store, clock, seed=1))
    ran, listed = [], []
    for claim in walk:
        ran.append(claim.task_id)
        listed.append(sum(1 for op, name, t in store.requests if op == "list" and name.startswith((layout.TASKS, layout.LEASES))))
        claim.lease.complete([], clock.now)
        if claim.task_id == "a24":
            rewrite(store, "a25", state=RELEASED)
        if claim.task_id == "a25" or len(ran) > 30:
            break
    trail = ids.index(ran[0])
    k = ran.index(ids[trail - 1])  # the end of the run before the trail
    assert trail > 2 and ran[k + 1] == "a25" and listed[k + 1] == listed[k], ran


def test_past_a_held_stretch_the_leases_are_re_listed_before_the_walk_lands_beyond_it(tmp_path):
    """Region b: b00-b39 free, b40 held, b41-b79 free; the head region's only task is held. While
    the worker walks b's first run from where it landed, another worker takes the tasks behind it and
    b41-b60. Past b40 the worker re-lists b's leases, so it lands in b61-b79, the one run still
    free, with no collision."""
    ids = ids_of("b", 80)
    store, clock = queue(tmp_path, ["a1"] + ids, splits=["b00"])
    lease(store, "a1", HELD)
    lease(store, "b40", HELD)
    walk = iter(claimer(store, clock, seed=1))
    ran = []
    for claim in walk:
        ran.append(claim.task_id)
        claim.lease.complete([], clock.now)
        if len(ran) == 1:
            for task_id in ids[:ids.index(claim.task_id)] + ids[41:61]:
                lease(store, task_id, HELD)
        if claim.task_id == "b39" or len(ran) > 45:
            break
    beyond = next(walk).task_id
    creates = [name for op, name, t in store.requests if op == "create" and name.startswith(layout.LEASES)]
    assert ran[-1] == "b39" and 61 <= ids.index(beyond) <= 79 and len(creates) == len(ran) + 1, (ran, beyond)


def test_past_a_held_stretch_a_short_run_is_walked_on_when_no_other_region_has_work(tmp_path):
    """Region a: a00-a09 free, a10 held, a11-a14 free (fewer than MIN_RUN); regions b and c hold one
    held task each. Past a10 the worker re-lists a's leases, moves, finds nothing in b and c, and
    then walks on to a11 at once, without a wait (and without re-listing and moving again)."""
    ids = ids_of("a", 15)
    store, clock = queue(tmp_path, ids + ["b1", "c1"], splits=["b1", "c1"])
    for task_id in ("a10", "b1", "c1"):
        lease(store, task_id, HELD)
    walk = iter(claimer(store, clock, seed=0))
    ran = []
    for claim in walk:
        ran.append(claim.task_id)
        claim.lease.complete([], clock.now)
        if claim.task_id == "a11" or len(ran) > 15:
            break
    assert ran == ids[ids.index(ran[0]):10] + ["a11"] and clock.waits == [], ran
    assert store.count("list", "leases/b1.json") == 1 and store.count("list", "leases/c1.json") == 1


@pytest.mark.parametrize("seed", [0])
def test_a_move_to_a_region_nobody_touched_lands_around_its_middle(tmp_path, seed):
    """Region a holds one task, region b forty free ones. With this seed the start lands on a1; once
    it is done the walk moves to b and lands around its middle (20, give or take 40 // 4): only the
    start lands at a random spot of an untouched region (with this seed b02)."""
    store, clock = queue(tmp_path, ["a1"] + ids_of("b", 40), splits=["b00"])
    walk = iter(claimer(store, clock, seed=seed))
    first = next(walk)
    first.lease.complete([], clock.now)
    assert first.task_id == "a1"
    nxt = next(walk).task_id
    assert nxt.startswith("b") and 10 <= int(nxt[1:]) <= 30, nxt


def test_a_start_on_a_queue_with_nothing_to_claim_loads_its_one_region_once(tmp_path):
    """One region, its only task held: the start's move loads it (tasks and leases), lands nowhere and
    waits; it does not load it again as the walk's own region, which it does not have yet."""
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", HELD)
    claims = claimer(store, clock)
    store.hooks.insert(0, lambda op, name: clock.waits and claims.stop())
    assert list(claims) == [] and claims.exit_reason == "stopped"
    assert store.count("list", layout.TASKS) == 1 and store.count("list", layout.LEASES) == 2  # the start, one poll


def test_a_move_skips_a_region_it_knows_has_nothing_to_claim(tmp_path):
    """Region b's only task is held by a live holder; the worker loads b, then a, runs a's tasks and
    moves: b is known to have nothing claimable, so the move does not re-list it (the first poll does)."""
    store, clock = queue(tmp_path, ["a1", "a2", "a3", "b1"], splits=["b1"])
    lease(store, "b1", HELD)
    store.hooks.append(renewing(store))
    claims = claimer(store, clock, seed=1, idle_timeout_s=600.0)
    store.hooks.insert(0, lambda op, name: len(clock.waits) >= 3 and claims.stop())
    assert sorted(run_all(claims, clock)) == ["a1", "a2", "a3"]
    listed = [name for op, name, t in store.requests if op == "list"]
    first_poll = [k for k, name in enumerate(listed) if name == layout.BATCHES][1]
    assert listed.index("tasks/b1.json") < listed.index("tasks/")  # b was loaded first
    assert listed[:first_poll].count("leases/b1.json") == 1 and listed[first_poll + 1] == "leases/b1.json"


# -- waiting and leaving --------------------------------------------------------------------------


@pytest.mark.parametrize("poll_min_s, first", [(1.0, 2.0), (3.0, 3.0)])
def test_a_worker_with_nothing_to_claim_waits_from_an_eighth_of_its_longest_wait_doubling_to_it(tmp_path, poll_min_s, first):
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", HELD)
    store.hooks.append(renewing(store))
    claims = claimer(store, clock, poll_min_s=poll_min_s, poll_max_s=16.0, idle_timeout_s=60.0)
    assert list(claims) == [] and claims.exit_reason == "idle"
    bounds = [first, 2 * first, 4 * first, 8 * first] + [16.0] * 10
    for wait, high in zip(clock.waits, bounds):
        assert min(high, 16.0) / 2 <= wait <= min(high, 16.0), clock.waits
    assert 160.0 <= clock.now < 160.0 + 16.0


def test_a_claim_after_waiting_starts_the_backoff_again(tmp_path):
    store, clock = queue(tmp_path, ["a1", "a2"])
    lease(store, "a1", HELD, ttl_s=20.0)
    lease(store, "a2", HELD, ttl_s=60.0)
    claims = claimer(store, clock, poll_max_s=16.0, idle_timeout_s=5.0)
    walk = iter(claims)
    first = next(walk)
    assert first.task_id == "a1"
    before = len(clock.waits)
    first.lease.complete([], clock.now)
    second = next(walk)
    assert second.task_id == "a2"
    assert 1.0 <= clock.waits[before] <= 2.0  # from the first wait again, not from where it had got to


def test_a_worker_does_not_leave_idle_beside_a_lease_it_has_not_judged(tmp_path, caplog):
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", HELD, ttl_s=30.0)  # its holder died: nobody renews it
    claims = claimer(store, clock, idle_timeout_s=5.0)
    with caplog.at_level(logging.DEBUG, logger="taskqueue.claims"):
        assert run_all(claims, clock) == ["a1"] and claims.exit_reason == "drained"
    assert "event=idle_deferred unjudged=1 first=a1" in caplog.messages


def test_a_worker_leaves_idle_beside_leases_it_saw_renew_once_the_idle_timeout_has_passed(tmp_path, caplog):
    store, clock = queue(tmp_path, ["a1", "b1"], splits=["b1"])
    lease(store, "a1", HELD)
    lease(store, "b1", HELD)
    store.hooks.append(renewing(store))
    claims = claimer(store, clock, idle_timeout_s=20.0)
    with caplog.at_level(logging.INFO, logger="taskqueue.claims"):
        assert list(claims) == [] and claims.exit_reason == "idle"
    assert 120.0 <= clock.now < 120.0 + 8.0
    (line,) = [m for m in caplog.messages if m.startswith("event=idle_timeout")]
    assert line.endswith("open_regions=2") and 20.0 <= float(line.split("waited_s=")[1].split()[0]) < 20.0 + 8.0


def test_an_idle_timeout_of_zero_leaves_without_a_wait_once_every_lease_in_view_is_seen_renewing(tmp_path):
    """a2 is held by a live holder. The worker runs a1; its move re-lists a's leases and sees a2
    renewed: with `--idle-timeout 0` it leaves `idle` on that turn, after its last look, with no wait."""
    store, clock = queue(tmp_path, ["a1", "a2"])
    lease(store, "a2", HELD)
    store.hooks.append(renewing(store))
    claims = claimer(store, clock, idle_timeout_s=0.0)
    assert run_all(claims, clock) == ["a1"] and claims.exit_reason == "idle" and clock.waits == []


def test_the_last_look_before_leaving_idle_finds_a_task_no_poll_listed(tmp_path):
    """a2 appears without a batch marker while the worker waits: polls re-list leases only, the last
    look lists tasks too."""
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", HELD)
    store.hooks.append(renewing(store))
    claims = claimer(store, clock, idle_timeout_s=20.0)
    walk = iter(claims)
    store.hooks.append(lambda op, name: op == "list" and clock.now > 100 and not list_of(store, "tasks/a2")
                       and store.plain.create(layout.task_object("a2"), b'{"id": "a2"}'))  # fmt: skip
    claim = next(walk)
    assert claim.task_id == "a2" and clock.now >= 120.0


def test_news_found_by_the_last_look_keeps_the_worker_from_leaving_idle(tmp_path):
    """A batch is submitted just before the last look lists batches/ (the poll of the same turn saw
    nothing): the worker claims its task instead of leaving."""
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", HELD)
    store.hooks.append(renewing(store))

    def submit():
        store.plain.create(layout.task_object("c1"), b'{"id": "c1"}')
        store.plain.create(layout.split_object("c1"), b"{}")
        store.plain.create(layout.batch_object("b"), b"{}", {"state": "done", "first": "c1", "last": "c1", "tasks": "1"})
        return clock.now

    hook, submitted = at_the_last_look(clock, submit)
    store.hooks.append(hook)
    claims = claimer(store, clock, idle_timeout_s=20.0)
    claim = next(iter(claims), None)
    assert submitted and claim is not None and claim.task_id == "c1", claims.exit_reason


def test_a_task_the_last_look_found_taken_first_sends_the_worker_on_without_waiting(tmp_path):
    """Regions a and d, each with a task held by a live holder; the view caches one region. Tasks a2 and
    d2 appear, without a batch marker, just before the last look: it lands on a2, which another
    worker creates a lease for just before this one does. The worker moves on to d at once (it is
    not waiting any more: the last look found work), not after another wait and poll."""
    store, clock = queue(tmp_path, ["a1", "d1"], splits=["d1"])
    lease(store, "a1", HELD)
    lease(store, "d1", HELD)
    store.hooks.append(renewing(store))

    def tasks_appear():
        store.plain.create(layout.task_object("a2"), b'{"id": "a2"}')
        store.plain.create(layout.task_object("d2"), b'{"id": "d2"}')
        return len(clock.waits)

    hook, appeared = at_the_last_look(clock, tasks_appear)
    store.hooks += [hook, created_first(store, "a2")]
    claim = next(iter(claimer(store, clock, idle_timeout_s=20.0, max_loaded_regions=1)), None)
    assert appeared and claim is not None and claim.task_id == "d2"
    assert len(clock.waits) == appeared[0]  # no wait between the last look and the claim


def test_a_task_the_last_look_found_taken_first_restarts_the_idle_timeout(tmp_path):
    """As above with region a alone: a2 appears just before the last look, and another worker (alive)
    creates its lease just before this one does. Nothing else is left: the worker waits out a whole
    idle timeout again from there, then leaves `idle`."""
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", HELD)
    store.hooks.append(renewing(store))

    def a2_appears():
        store.plain.create(layout.task_object("a2"), b'{"id": "a2"}')
        return clock.now

    hook, appeared = at_the_last_look(clock, a2_appears)
    store.hooks += [hook, created_first(store, "a2")]
    claims = claimer(store, clock, idle_timeout_s=20.0)
    assert list(claims) == [] and claims.exit_reason == "idle" and appeared
    assert appeared[0] + 20.0 <= clock.now < appeared[0] + 20.0 + 8.0 + 8.0


def test_a_lease_the_last_look_sees_first_is_watched_a_whole_ttl_before_the_worker_leaves(tmp_path):
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", HELD)
    store.hooks.append(renewing(store))
    claims = claimer(store, clock, idle_timeout_s=20.0)
    added = []

    def dead_task_appears(op, name):  # a task with a lease of a dead holder, no batch marker
        if op == "list" and name.startswith(layout.TASKS) and clock.now > 100 and not added:
            store.plain.create(layout.task_object("a2"), b'{"id": "a2"}')
            added.append(lease(store, "a2", HELD, worker="gone", ttl_s=30.0))

    store.hooks.append(dead_task_appears)
    claim = next(iter(claims))
    (last_look,) = [t for op, name, t in store.requests if op == "list" and name.startswith(layout.TASKS) and t > 100][:1]
    assert last_look >= 120.0 and claim.task_id == "a2" and clock.now >= last_look + 30.0


@pytest.mark.parametrize("seed", [6])
def test_a_last_look_lands_in_the_middle_of_a_region_no_move_or_poll_loaded(tmp_path, seed):
    """As below, with region c of forty free tasks, and a seed whose move loads a and b and whose polls
    never explore c before the idle timeout: the last look loads every open region, and the walk
    starts around the middle of c (20, give or take 40 // 4), not at a random spot as a start does
    (with this seed at c34)."""
    store, clock = queue(tmp_path, ["a1", "b1"] + ids_of("c", 40), splits=["b1", "c00"])
    lease(store, "a1", HELD)
    lease(store, "b1", HELD)
    store.hooks.append(renewing(store))
    claim = next(iter(claimer(store, clock, seed=seed, idle_timeout_s=20.0)))
    loads = [(name, t) for op, name, t in store.requests if op == "list" and name.startswith(layout.TASKS)]
    (first_load_of_c,) = [t for name, t in loads if name == "tasks/c00.json"][:1]
    assert first_load_of_c >= 120.0 and ("tasks/", first_load_of_c) in loads  # the last look: every region
    assert claim.task_id.startswith("c") and 10 <= int(claim.task_id[1:]) <= 30, claim.task_id


@pytest.mark.parametrize("seed", [5, 6, 10])
def test_a_waiting_worker_explores_a_region_it_never_loaded_long_before_its_last_look(tmp_path, seed):
    """Regions a and b hold leases renewed by a live holder, region c twenty free tasks. With these
    seeds the first move loads a and b (JUMP_TRIES) and finds nothing: the worker waits, and one of
    its polls loads c, however long the idle timeout, and lands in the middle of it (only the start's
    move lands at a random spot of an untouched region)."""
    store, clock = queue(tmp_path, ["a1", "b1"] + ids_of("c", 20), splits=["b1", "c00"])
    lease(store, "a1", HELD)
    lease(store, "b1", HELD)
    store.hooks.append(renewing(store))
    claim = next(iter(claimer(store, clock, seed=seed, idle_timeout_s=600.0)))
    assert claim.task_id.startswith("c") and clock.waits and clock.now < 200.0
    assert 5 <= int(claim.task_id[1:]) <= 15


def test_a_waiting_worker_mostly_re_lists_the_leases_of_the_region_it_looked_at_longest_ago(tmp_path):
    """Ten regions, each with one task held by a live holder; the view caches eight, so two are always
    unwatched. Of a waiting worker's polls, about one in four loads a region it does not watch
    (tasks and leases; 7 of 16 with this seed), the rest re-list the leases of the watched region
    looked at longest ago."""
    ids = [f"{c}1" for c in "abcdefghij"]
    store, clock = queue(tmp_path, ids, splits=ids[1:])
    for task_id in ids:
        lease(store, task_id, HELD)
    store.hooks.append(renewing(store))
    claims = claimer(store, clock, seed=7, idle_timeout_s=600.0)
    store.hooks.insert(0, lambda op, name: len(clock.waits) == 13 and claims.stop())
    assert list(claims) == []
    polls = [(op, name) for op, name, t in store.requests
             if t > 100 and op == "list" and name.startswith((layout.TASKS, layout.LEASES))]  # fmt: skip
    loads = sum(1 for op, name in polls if name.startswith(layout.TASKS))
    assert 1 <= loads <= 0.6 * (len(polls) - loads), polls
    refreshed = [name for op, name in polls if name.startswith(layout.LEASES)]
    assert len(set(refreshed[:3])) == len(refreshed[:3])  # each re-list goes to another region


def test_news_of_a_batch_sends_a_waiting_worker_to_its_regions_within_a_poll(tmp_path):
    """Regions a and b are held by a live holder; a batch adds region c while the worker waits: the
    next poll's listing of batches/ sends it to the regions the batch met, without another wait."""
    store, clock = queue(tmp_path, ["a1", "b1"], splits=["b1"])
    lease(store, "a1", HELD)
    lease(store, "b1", HELD)
    store.hooks.append(renewing(store))
    claims = claimer(store, clock, idle_timeout_s=600.0)
    submitted = []

    def submit_c1(op, name):
        if op == "list" and name == layout.BATCHES and clock.now > 110 and not submitted:
            plain = LocalStore(tmp_path / "q")
            plain.create(layout.task_object("c1"), b'{"id": "c1"}')
            plain.create(layout.split_object("c1"), b"{}")
            plain.create(layout.batch_object("b"), b"{}", {"state": "done", "first": "c1", "last": "c1", "tasks": "1"})
            submitted.append((clock.now, len(clock.waits)))

    store.hooks.append(submit_c1)
    claim = next(iter(claims))
    (at, waits), = submitted
    assert claim.task_id == "c1" and len(clock.waits) == waits  # no wait between the news and the claim
    since = [name for op, name, t in store.requests if op == "list" and t >= at]
    assert since.count(layout.BATCHES) == 1  # the news is listed once: the map after it is listed without batches/
    # a's region is no news (b's is: before the batch's split was listed, b ran to the keyspace's end)
    assert layout.TASKS not in since and layout.LEASES not in since


def test_a_poll_of_a_region_under_a_running_batch_lists_its_tasks_again(tmp_path):
    """Regions a and b hold leases renewed by a live holder; a batch running since before the start
    covers b2, and creates it while the worker waits (its marker does not change: no news). A poll
    of b lists b's tasks, not only its leases, and finds b2 long before the last look."""
    store, clock = queue(tmp_path, ["a1", "b1"], splits=["b1"])
    lease(store, "a1", HELD)
    lease(store, "b1", HELD)
    store.plain.create(layout.batch_object("b"), b"{}", {"state": "running", "first": "b2", "last": "b2", "tasks": "1"})
    store.hooks.append(renewing(store))
    store.hooks.append(lambda op, name: clock.now > 110 and not list_of(store, "tasks/b2")
                       and store.plain.create(layout.task_object("b2"), b'{"id": "b2"}'))  # fmt: skip
    claim = next(iter(claimer(store, clock, idle_timeout_s=600.0)))
    assert claim.task_id == "b2" and clock.now < 200.0


def test_news_is_spent_once_the_move_has_visited_its_region(tmp_path):
    """As above, but c1 comes with a lease its live holder renews: the move the news set off visits
    c and finds nothing. The news is spent: the polls after it list batches/ and one region each, not
    the map again at every poll (and a move after it)."""
    store, clock = queue(tmp_path, ["a1", "b1"], splits=["b1"])
    lease(store, "a1", HELD)
    lease(store, "b1", HELD)
    store.hooks.append(renewing(store))
    claims = claimer(store, clock, idle_timeout_s=600.0)
    store.hooks.insert(0, lambda op, name: len(clock.waits) >= 7 and claims.stop())
    submitted = []

    def submit_c1(op, name):
        if op == "list" and name == layout.BATCHES and clock.now > 110 and not submitted:
            store.plain.create(layout.task_object("c1"), b'{"id": "c1"}')
            store.plain.create(layout.split_object("c1"), b"{}")
            lease(store, "c1", HELD)
            store.plain.create(layout.batch_object("b"), b"{}", {"state": "done", "first": "c1", "last": "c1", "tasks": "1"})
            submitted.append(clock.now)

    store.hooks.append(submit_c1)
    assert list(claims) == [] and submitted
    later = [name for op, name, t in store.requests if op == "list" and t > submitted[0]]  # the polls after the news
    assert later.count(layout.BATCHES) >= 2 and layout.SPLITS not in later, later


def test_a_batch_that_came_and_went_between_two_polls_sends_the_worker_to_the_region_it_cut(tmp_path):
    """Region a is held by a live holder; the worker runs b1, sweeps region b (to the keyspace's end,
    as it knows the map) and waits. A batch cuts region c and is deleted between two polls: only
    PRUNED tells (its `before` is later than everything listed before). The poll that sees it lists
    the map again, and the worker claims c1 long before its idle timeout."""
    store, clock = queue(tmp_path, ["a1", "b1"], splits=["b1"])
    lease(store, "a1", HELD)
    store.hooks.append(renewing(store))
    came_and_went = []

    def batch_came_and_went(op, name):
        if op == "list" and name == layout.BATCHES and list_of(store, layout.SWEPT) and not came_and_went:
            store.plain.create(layout.task_object("c1"), b'{"id": "c1"}')
            store.plain.create(layout.split_object("c1"), b"{}")
            came_and_went.append(store.plain.create(layout.PRUNED, b"{}", {"before": "2100-01-01T00:00:00+00:00"}))

    walk = iter(claimer(store, clock, idle_timeout_s=600.0))
    first = next(walk)
    assert first.task_id == "b1"
    first.lease.complete([], clock.now)
    store.hooks.append(batch_came_and_went)
    claim = next(walk)
    assert came_and_went and claim.task_id == "c1" and clock.now < 200.0


@pytest.mark.parametrize("before", [layout.SPLITS, layout.BATCHES])
def test_a_worker_is_not_drained_while_a_batch_begins_during_its_drained_check(tmp_path, before):
    """The drained check lists batches/, then the map, then batches/ again. A submit begins between
    the two listings of batches/ (a marker that changed), or just before the first (a batch running
    in both: the map shows its region open)."""
    store, clock = queue(tmp_path, ["a1"])
    plain = LocalStore(tmp_path / "q")
    begun = []

    def begin_during_the_drained_check(op, name):
        if op == "list" and name == before and list_of(store, layout.SWEPT) and not begun:
            plain.create(layout.batch_object("b"), b"{}", {"state": "running", "first": "a2", "last": "a2", "tasks": "1"})
            plain.create(layout.task_object("a2"), b'{"id": "a2"}')
            begun.append(clock.now)

    store.hooks.append(begin_during_the_drained_check)
    claims = claimer(store, clock, idle_timeout_s=600.0)
    walk = iter(claims)
    ran = [next(walk)]
    ran[0].lease.complete([], clock.now)
    ran.append(next(walk))
    assert [c.task_id for c in ran] == ["a1", "a2"] and begun
    ran[1].lease.complete([], clock.now)
    current = store.plain.read(layout.batch_object("b"))
    plain.write(layout.batch_object("b"), b"{}", current.generation, {"state": "done", "first": "a2", "last": "a2", "tasks": "1"})
    assert list(walk) == [] and claims.exit_reason == "drained"


def test_a_prune_during_the_drained_check_of_markers_older_than_those_listed_does_not_defer_it(tmp_path):
    """A prune rewrites PRUNED between the drained check's two listings of batches/, with a `before`
    older than every marker the first listing showed: no batch can have come and gone unseen, and
    the worker leaves drained at once, without another wait and check."""
    store, clock = queue(tmp_path, ["a1"])
    store.plain.create(layout.batch_object("b"), b"{}", {"state": "done", "first": "a1", "last": "a1", "tasks": "1"})
    pruned = []

    def prune_during_the_drained_check(op, name):
        if op == "list" and name == layout.SPLITS and list_of(store, layout.SWEPT) and not pruned:
            pruned.append(store.plain.create(layout.PRUNED, b"{}", {"before": "2000-01-01T00:00:00+00:00"}))

    store.hooks.append(prune_during_the_drained_check)
    claims = claimer(store, clock)
    assert run_all(claims, clock) == ["a1"] and claims.exit_reason == "drained"
    assert pruned and clock.waits == []


def test_a_move_from_a_region_the_cache_dropped_lists_it_once(tmp_path):
    """Regions "" (a0, and a1 held by a live w0), b1 and d1 (held by w0); the view caches one region.
    The worker runs a0, and its move loads b and d (nothing there), which drops "" from the cache.
    News of a batch that cuts region c1 (its task held by w0 already) sends it moving again: the news
    regions, then "" as a region it has not loaded, once; not again as the walk's own region."""
    store, clock = queue(tmp_path, ["a0", "a1", "b1", "d1"], splits=["b1", "d1"])
    for task_id in ("a1", "b1", "d1"):
        lease(store, task_id, HELD)
    store.hooks.append(renewing(store))
    news = []

    def submit_c1(op, name):
        if op == "list" and name == layout.BATCHES and clock.waits and not news:
            store.plain.create(layout.task_object("c1"), b'{"id": "c1"}')
            store.plain.create(layout.split_object("c1"), b"{}")
            lease(store, "c1", HELD)
            store.plain.create(layout.batch_object("b"), b"{}", {"state": "done", "first": "c1", "last": "c1", "tasks": "1"})
            news.append(len(store.requests))

    store.hooks.append(submit_c1)
    claims = claimer(store, clock, seed=0, max_loaded_regions=1)
    store.hooks.insert(0, lambda op, name: len(clock.waits) > 1 and claims.stop())
    assert run_all(claims, clock) == ["a0"] and claims.exit_reason == "stopped" and news
    at = store.requests[news[0] - 1][2]  # the poll's listing of batches/ that found the news
    moved = [name for op, name, t in store.requests[news[0]:] if op == "list" and t == at]
    assert sorted(moved) == sorted(["splits/", "swept/", "tasks/b1.json", "leases/b1.json", "tasks/c1.json",
                                    "leases/c1.json", "tasks/", "leases/"]), moved  # fmt: skip


def test_a_move_that_gives_up_lists_the_rest_of_the_map_once(tmp_path):
    """Seven regions, their six split markers on three pages, each task held: the start lists the
    first page, its move loads JUMP_TRIES regions and gives up, then lists the whole map once (three
    pages), not page after page again for each page it adds."""
    ids = [f"{c}1" for c in "abcdefg"]
    store, clock = queue(tmp_path, ids, splits=ids[1:])
    store.splits_page = 2
    for task_id in ids:
        lease(store, task_id, HELD)
    claims = claimer(store, clock)
    store.hooks.insert(0, lambda op, name: clock.waits and claims.stop())
    assert list(claims) == [] and claims.exit_reason == "stopped"
    assert store.count("list", layout.SPLITS) == 1 + 3


def test_a_start_that_found_nothing_on_a_page_of_the_map_lists_the_head_regions_leases_once(tmp_path):
    """Regions "" (a1, held by a live w0), b1 and c1 (both run and swept by w2), one split marker a
    page. The start loads the head region and finds nothing; each page it adds holds only a swept
    region, so it goes on to the end of the map and waits, having listed the head's leases once: the
    walk is in no region yet, and a region it has not landed in is not visited again as its own."""
    store, clock = queue(tmp_path, ["a1", "b1", "c1"], splits=["b1", "c1"])
    lease(store, "a1", HELD)
    store.hooks.append(renewing(store))
    assert sorted(run_all(claimer(store, clock, worker="w2", idle_timeout_s=5.0), clock)) == ["b1", "c1"]
    assert {e.name for e in list_of(store, layout.SWEPT)} == {"swept/b1.json", "swept/c1.json"}
    store.splits_page, start, since = 1, clock.now, len(store.requests)
    claims = claimer(store, clock)
    store.hooks.insert(0, lambda op, name: clock.now > start and claims.stop())
    assert list(claims) == [] and claims.exit_reason == "stopped"
    listed = [name for op, name, t in store.requests[since:] if op == "list" and t == start]
    assert listed.count("leases/") == 1 and listed.count(layout.SPLITS) == 1 + 2, listed  # the start's page, then both


def test_a_lone_worker_that_ran_every_region_sweeps_each_as_it_leaves_it_and_leaves_drained_at_once(tmp_path):
    """Five regions of two tasks, one worker. Each region it walks to its end it knows finished (its
    own tombstones): it sweeps it as it moves on, and leaves `drained` without a wait; not `idle`, as
    it did when only polls swept those regions, one a poll, and its idle timeout came first."""
    ids = [f"{c}{k}" for c in "abcde" for k in range(2)]
    store, clock = queue(tmp_path, ids, splits=["b0", "c0", "d0", "e0"])
    claims = claimer(store, clock, seed=0, idle_timeout_s=5.0)
    assert sorted(run_all(claims, clock)) == ids
    assert claims.exit_reason == "drained" and clock.waits == [] and len(list_of(store, layout.SWEPT)) == 5


def test_a_worker_leaves_drained_only_once_every_page_of_the_map_is_swept(tmp_path):
    ids = [f"{c}1" for c in "abcdefg"]
    store, clock = queue(tmp_path, ids, splits=ids[1:])
    store.splits_page = 2  # seven regions: four pages of the map
    claims = claimer(store, clock)
    assert sorted(run_all(claims, clock)) == ids and claims.exit_reason == "drained"
    assert len(list_of(store, layout.SWEPT)) == 7


# -- outages and stops ----------------------------------------------------------------------------


def test_a_store_outage_is_waited_out_with_a_growing_backoff(tmp_path, caplog):
    store, clock = queue(tmp_path, ["a1"])
    store.hooks.append(failing("list", layout.SPLITS, StoreUnavailable("splits/: 503"), times=4))
    with caplog.at_level(logging.WARNING, logger="taskqueue.claims"):
        claim = next(iter(claimer(store, clock, poll_min_s=1.0, poll_max_s=4.0)))
    assert claim.task_id == "a1"
    assert len(clock.waits) == 4 and all(0 <= w <= high for w, high in zip(clock.waits, [1.0, 2.0, 4.0, 4.0]))
    assert clock.waits[2] > 2.0 or clock.waits[3] > 2.0 or clock.waits[1] > 1.0  # it grew past the first
    assert caplog.messages[:2] == ["event=store_unavailable step=_start error=splits/: 503 retry_in_s=1.0",
                                   "event=store_unavailable step=_start error=splits/: 503 retry_in_s=2.0"]  # fmt: skip
    assert caplog.messages[3].endswith("retry_in_s=4.0")
    assert clock.waits[0] < 1.0  # jittered from 0, not from the shortest wait: workers cut off together spread out


def test_a_stop_during_an_outage_ends_the_walk_stopped(tmp_path):
    store, clock = queue(tmp_path, ["a1"])
    store.hooks.append(failing("list", layout.SPLITS, StoreUnavailable("splits/: 503"), times=100))
    claims = claimer(store, clock)
    store.hooks.insert(0, lambda op, name: len(clock.waits) == 2 and claims.stop())
    assert list(claims) == [] and claims.exit_reason == "stopped" and len(clock.waits) == 3


def test_a_stop_while_waiting_ends_the_walk_stopped(tmp_path):
    store, clock = queue(tmp_path, ["a1"])
    lease(store, "a1", HELD)
    store.hooks.append(renewing(store))
    claims = claimer(store, clock)
    store.hooks.append(lambda op, name: len(clock.waits) == 3 and claims.stop())
    assert list(claims) == [] and claims.exit_reason == "stopped" and len(clock.waits) == 3


@pytest.mark.parametrize("poll_min_s, ttl_s, longest", [(1.0, 30.0, 15.0), (1.0, 600.0, 60.0), (20.0, 30.0, 20.0)])
def test_the_longest_wait_is_half_a_ttl_at_most_a_minute_at_least_the_shortest(poll_min_s, ttl_s, longest):
    assert default_poll_max(poll_min_s, ttl_s) == longest


def test_the_start_line_names_the_map_it_listed_and_where_the_walk_starts(tmp_path, caplog):
    """Seven regions whose split markers come two a page: the start lists one page of the map (three
    regions, the last of them running on to the keyspace's end as far as the worker knows) and lands
    (with this seed outside the head region, whose name is "": each other region is named for its one task)."""
    ids = [f"{c}1" for c in "abcdefg"]
    store, clock = queue(tmp_path, ids, splits=ids[1:])
    store.splits_page = 2
    with caplog.at_level(logging.INFO, logger="taskqueue.claims"):
        claim = next(iter(claimer(store, clock)))
    (line,) = [m for m in caplog.messages if m.startswith("event=start ")]
    assert line == f"event=start regions=3 swept=0 map_complete=False region={claim.task_id!r}", line


def test_a_sweep_is_written_as_this_worker_and_its_confirming_wait_is_on_the_workers_clock(tmp_path):
    """A store that allows one write a second to an object (as GCS): the sweep waits out that gap
    between its marker's create and its confirming write, on the worker's clock and stop event, and
    the marker names the worker."""
    store, clock = queue(tmp_path, ["a1"])
    store.same_object_write_gap_s = 1.0
    claims = claimer(store, clock)
    assert run_all(claims, clock) == ["a1"] and claims.exit_reason == "drained"
    (marker,) = list_of(store, layout.SWEPT)
    (created,) = [t for op, name, t in store.requests if op == "create" and name == marker.name]
    (confirmed,) = [t for op, name, t in store.requests if op == "write" and name == marker.name]
    assert confirmed == created + 1.0
    assert json.loads(store.plain.read(marker.name).data)["worker"] == "w1" and marker.metadata["confirmed"] == "1"
