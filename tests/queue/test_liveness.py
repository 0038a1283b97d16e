"""Issue 25: no task stranded, no early `complete`. Real `Claimer`s, `submit` and `status.snapshot`
against real stores (a local directory; the first test also the fake GCS server over HTTP). The
regression tests of the issue's three defects failed on the code before their fix."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
import shutil
import subprocess
import sys
import threading
import time

import pytest

from objectstore import open_store
from objectstore.counting import CountingStore
from objectstore.local import LocalStore
from taskqueue import layout
from taskqueue.claims import Claimer, ClaimOptions, QueueView
from taskqueue.clock import Clock
from taskqueue.lease import HeldLease, encode, new_lease_body
from reporting.status import render, snapshot
from taskqueue.submit import SubmitError, batch_id, batch_name, begin_batch, finish_batch, prune_batches, submit
from tests.workers import REPO, renewing


def tasks(*ids: str) -> list[tuple[str, bytes]]:
    return [(t, json.dumps({"id": t}).encode()) for t in ids]


def hold(store, task_id: str, worker: str, ttl_s: float) -> HeldLease:
    """A lease held by `worker`, as its claim would create it."""
    body = new_lease_body(task_id, worker, ttl_s, Clock())
    data, metadata = encode(body)
    return HeldLease(store, body, store.create(layout.lease_object(task_id), data, metadata=metadata), Clock())


# -- a waiting worker never leaves beside a lease it has not watched for a whole TTL ------------


def test_a_waiting_worker_watches_a_lease_first_seen_late_for_a_whole_ttl_before_leaving_idle(queue_url):
    """The last waiting worker first sees a dead holder's lease late in its wait (a task submitted
    and claimed by a holder that died at once). Before, its exit was deferred only until the idle
    timeout plus a TTL counted from when it became idle, so it left `idle` beside that lease, and
    nobody was left to take it over (sim seed 71606). It must watch the lease for the lease's whole
    TTL from its first sighting, then take it over."""
    store = open_store(queue_url)
    submit(store, b"{}", tasks("live"))
    live = hold(store, "live", "alive", ttl_s=10.0)  # a live holder whose first renewal comes late
    stop = threading.Event()

    def holder() -> None:
        if stop.wait(2.2):
            return
        while not stop.is_set():
            live.heartbeat()
            stop.wait(0.3)

    ttl = 2.0
    worker = Claimer(store, ClaimOptions(worker="w", lease_ttl_s=ttl, idle_timeout_s=0.5, poll_min_s=0.02,
                                         poll_max_s=0.1, seed=1))  # fmt: skip
    claimed: list[tuple[str, float]] = []

    def run() -> None:
        for claim in worker:
            claimed.append((claim.task_id, time.monotonic()))
            claim.lease.complete([], time.monotonic())

    threads = [threading.Thread(target=holder), threading.Thread(target=run)]
    for thread in threads:
        thread.start()
    try:
        # Two seconds into the worker's wait, past its idle timeout and before the live holder's first renewal (2.2 s):
        # the scenario's own time. That the worker waits by then is checked, not hoped for.
        time.sleep(2.0)
        assert worker.view.leases.get("live") is not None, "the worker has not looked at the queue in 2 s"
        # A task submitted now, and held at once by a holder that dies without a heartbeat (its lease
        # is there before the task, so that the waiting worker cannot claim the task first).
        created = time.monotonic()
        hold(store, "dead", "died", ttl_s=ttl)
        submit(store, None, tasks("dead"))
        threads[1].join(timeout=30)
    finally:
        stop.set()
        threads[0].join()
    assert not threads[1].is_alive()
    assert [t for t, _ in claimed] == ["dead"], f"left {worker.exit_reason!r} beside the dead holder's lease"
    assert claimed[0][1] - created >= ttl * 0.95  # taken over once its TTL had run since it was seen, not before
    assert worker.exit_reason == "idle"  # and then it left, the live holder's task still held


class StoppedClock(Clock):
    """A monotonic clock that moves only when the test moves it."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.mark.parametrize(("gap_s", "renewed"), [(59.0, True), (61.0, False)])
def test_a_lease_seen_changed_across_a_gap_longer_than_its_ttl_is_no_renewal(tmp_path, gap_s, renewed):
    """A lease whose generation changed between two listings less than a TTL apart was written by a
    holder alive within a TTL: the worker may leave `idle` beside it. Across a longer gap (a worker
    busy on its own task, or polling other regions) the change says nothing of now: the holder may
    have written it long ago and died since, so the worker must watch it for a whole TTL
    (`Sighting.renewed`, docs/PROTOCOL.md, G6)."""
    store = LocalStore(tmp_path / "q")
    submit(store, b"{}", tasks("t1"))
    lease = hold(store, "t1", "holder", ttl_s=60.0)
    clock = StoppedClock()
    view = QueueView(store, clock)
    view.scan_map()
    view.load(layout.HEAD)
    assert view.unjudged() == ["t1"]  # first seen now: not judged yet
    clock.now += gap_s
    lease.heartbeat()  # a new generation
    view.load(layout.HEAD)
    assert view.leases["t1"].renewed is renewed
    assert view.unjudged() == ([] if renewed else ["t1"])
    clock.now += 30.0  # seen again unchanged: a renewal seen stays seen, none seen stays unseen
    view.load(layout.HEAD)
    assert view.leases["t1"].renewed is renewed


# -- a submit that fails never leaves its batch running ----------------------------------------

FAST = dict(idle_timeout_s=1.0, poll_min_s=0.02, poll_max_s=0.1)


def drain(store, worker: str = "w") -> tuple[str, list[str]]:
    """Run a worker to its exit, completing every claim: its exit reason and what it ran."""
    claimer = Claimer(store, ClaimOptions(worker=worker, seed=1, **FAST))
    ran = [c.task_id for c in claimer if c.lease.complete([], time.monotonic())]
    return claimer.exit_reason, ran


def running_batches(store) -> list[str]:
    return [e.name for e in store.list(layout.BATCHES) if e.metadata.get("state") != layout.BATCH_DONE]


def test_a_submit_refused_for_a_changed_manifest_finishes_its_batch_so_the_queue_drains(tmp_path):
    """The issue's scenario through the tool: a task that exists with another manifest makes
    `tools/submit.py` exit 65. The batch's other tasks are created, and its marker must not stay
    `running` (before, no worker ever left `drained` and status never said complete)."""
    store = LocalStore(tmp_path / "q")
    submit(store, b"{}", tasks("a", "b"))
    changed = tmp_path / "tasks.jsonl"
    changed.write_text(json.dumps({"id": "b", "rows": 7}) + "\n" + json.dumps({"id": "c"}) + "\n")
    out = subprocess.run([sys.executable, "tools/submit.py", str(tmp_path / "q"), "--tasks", str(changed),
                          "--any-consumer"], cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 65, out.stderr
    assert "tasks/b.json" in out.stderr and "new id" in out.stderr
    assert running_batches(store) == []
    reason, ran = drain(store)
    assert reason == "drained" and sorted(ran) == ["a", "b", "c"]
    view = snapshot(store)
    assert view["complete"] and view["total"] == 3 and not view["submitting"]


def test_running_a_refused_submit_again_finishes_the_batch_an_older_submit_left_running(tmp_path):
    """A marker left `running` by an earlier refused submit (what the code before did): running
    the same submit again still refuses the changed task, but finishes that batch."""
    store = LocalStore(tmp_path / "q")
    submit(store, b"{}", tasks("a", "b"))
    batch = [("b", json.dumps({"id": "b", "rows": 7}).encode()), *tasks("c")]
    marker = batch_name(["b", "c"])
    store.create(marker, b"{}", metadata={"first": "b", "last": "c", "tasks": "2", "state": layout.BATCH_RUNNING})
    store.create(layout.task_object("c"), b'{"id": "c"}')  # what that submit created before it was refused
    assert running_batches(store) == [marker]
    with pytest.raises(SubmitError, match="tasks/b.json"):
        submit(store, None, batch)
    assert running_batches(store) == []
    assert drain(store)[0] == "drained"
    assert snapshot(store)["complete"]


class InterruptedAtCreate(CountingStore):
    """Ctrl-C (or SIGTERM, which tools/submit.py turns into the same) while the tasks are created."""

    interrupted = False

    def create(self, name, data, metadata=None):
        if name == layout.task_object("k2") and not self.interrupted:
            self.interrupted = True
            raise KeyboardInterrupt
        return super().create(name, data, metadata)


def test_an_interrupted_submit_finishes_its_batch_before_it_exits(tmp_path):
    store = LocalStore(tmp_path / "q")
    with pytest.raises(KeyboardInterrupt):
        submit(InterruptedAtCreate(store), b"{}", tasks("k1", "k2", "k3"), parallel=1)
    assert running_batches(store) == []
    created = sorted(layout.id_from_object(e.name, layout.TASKS) for e in store.list(layout.TASKS))
    assert "k1" in created and "k2" in created  # k2's create was cut short: sent again before the batch finished
    reason, ran = drain(store)
    assert reason == "drained" and sorted(ran) == created  # what it created, then nothing pending


def test_finish_batch_finishes_a_dead_submits_batch_and_the_queue_drains(tmp_path):
    """A submitter whose machine died leaves its batch running (it can run no handler); once its
    submit will never run again, `finish_batch` (`tools/submit.py --finish-batch`) finishes it."""
    store = LocalStore(tmp_path / "q")
    submit(store, b"{}", tasks("a0", "a2"))
    assert drain(store)[0] == "drained"  # swept
    ids = ["a1", "a3"]
    marker = batch_name(ids)
    begin_batch(store, marker, {"first": "a1", "last": "a3", "tasks": "2"})
    store.create(layout.task_object("a1"), b'{"id": "a1"}')  # then it died: no cut, no un-sweep, no done
    blocked = snapshot(store)
    assert not blocked["complete"] and blocked["submitting"]
    assert "event=batch_finished" in finish_batch(store, batch_id(marker))
    reason, ran = drain(store)
    assert reason == "drained" and ran == ["a1"]
    assert snapshot(store)["complete"] and snapshot(store)["total"] == 3


# -- status is never `complete` while a task submitted before its last listing lacks a marker -----


class Steps(CountingStore):
    """Calls `before(k)` ahead of its k-th request (reads and listings; writes too)."""

    def __init__(self, inner, before):
        super().__init__(inner)
        self.before = before

    def _count(self, op, name):
        self.before(self.requests)
        super()._count(op, name)


def test_status_is_never_complete_while_a_task_submitted_before_its_last_listing_lacks_a_marker(tmp_path):
    """Every interleaving of one submit (a task into a swept region) with one status snapshot: the
    submit's first j requests before the snapshot starts, the rest before the snapshot's k-th
    request, for every j and k. The snapshot may say `complete` only if the task did not exist yet
    when its last request was sent. Before, a whole submit landing between the snapshot's listing of
    `swept/` and of `batches/` left it `complete` with 5 tasks of 6."""
    drained = tmp_path / "drained"
    store = LocalStore(drained)
    submit(store, b"{}", tasks(*(f"m{k}" for k in range(5))))
    assert drain(store)[0] == "drained" and snapshot(store)["complete"]
    new = tasks("m2x")  # into the swept region
    trial = LocalStore(tmp_path / "count")
    shutil.copytree(drained, tmp_path / "count", dirs_exist_ok=True)
    submit_steps = CountingStore(trial)
    submit(submit_steps, None, new)
    status_steps = CountingStore(trial)
    snapshot(status_steps)
    cases = 0
    for j in range(submit_steps.requests + 1):
        for k in range(status_steps.requests + 1):
            case = tmp_path / f"case-{j}-{k}"
            shutil.copytree(drained, case)
            queue = LocalStore(case)
            go, paused = threading.Event(), threading.Event()

            def pause_at(step: int, j=j) -> None:
                if step == j:
                    paused.set()
                    go.wait(timeout=30)

            submitter = threading.Thread(target=lambda queue=queue, pause_at=pause_at: submit(Steps(queue, pause_at), None, new))
            submitter.start()
            paused.wait(timeout=30) if j < submit_steps.requests else submitter.join(timeout=30)
            exists_at: list[bool] = []

            def release_at(step: int, k=k, queue=queue, submitter=submitter) -> None:
                if step == k:
                    go.set()
                    submitter.join(timeout=30)
                exists_at.append(any(True for _ in queue.list(layout.task_object("m2x"))))

            view = snapshot(Steps(queue, release_at))
            go.set()
            submitter.join(timeout=30)
            assert not submitter.is_alive()
            if view["complete"]:
                assert not exists_at[-1], f"submit split at its request {j} and status' {k}: complete with m2x pending"
            cases += 1
    assert cases >= 40


# -- done batch markers are deleted, and a worker that did not see one still finds its tasks ---


def test_a_submit_deletes_done_batch_markers_older_than_the_keep_time_and_no_other(tmp_path):
    store = LocalStore(tmp_path / "q")
    keep = functools.partial(submit, batch_keep_s=1.0)
    keep(store, b"{}", tasks("a"))
    keep(store, None, tasks("b"))
    dead = batch_name(["c"])
    begin_batch(store, dead, {"first": "c", "last": "c", "tasks": "1"})  # a dead submit's: never deleted
    time.sleep(1.2)  # the markers' age on the store's clock (their `updated`) passes the keep time: what prunes them
    counted = CountingStore(store)
    keep(counted, None, tasks("d"))
    # The pruned marker goes first: a reader whose two listings of batches/ straddle the deletes sees it change.
    entries = {e.name: e for e in store.list(layout.BATCHES)}
    assert sorted(entries) == sorted([layout.PRUNED, dead, batch_name(["d"])])
    assert counted.counts["delete batches/"] == 2 and counted.counts["list batches/"] == 1
    assert counted.counts["create batches/"] == 2  # its own marker, and the pruned marker
    # `before` is the cutoff: every marker deleted was older (what lets a reader tell whether it missed one).
    assert entries[layout.PRUNED].metadata["before"] < entries[batch_name(["d"])].updated.isoformat()


@pytest.mark.parametrize(
    ("first", "second", "newest_s", "unseen"),
    [
        (None, None, 100, False),  # nothing ever pruned
        ((5, "T+050"), (5, "T+050"), 100, False),  # no prune in between
        (None, (6, "T+050"), 100, False),  # pruned since, but only markers older than the first listing's newest
        ((5, "T+050"), (6, "T+100"), 100, False),  # up to exactly the newest: those were all in the first listing
        ((5, "T+050"), (6, "T+101"), 100, True),  # a marker newer than the first listing may have come and gone
        ((5, "T+050"), (6, None), 100, True),  # a pruned marker that does not say: assume the worst
        ((5, "T+050"), (6, "T+050"), None, True),  # an empty first listing bounds nothing
    ],
)
def test_a_batch_may_have_come_and_gone_only_past_the_newest_update_of_the_first_listing(first, second, newest_s, unseen):
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)

    def mark(m):
        return None if m is None else (m[0], None if m[1] is None else (t0 + dt.timedelta(seconds=int(m[1][2:]))).isoformat())

    newest = None if newest_s is None else t0 + dt.timedelta(seconds=newest_s)
    assert layout.batch_unseen_between(mark(first), mark(second), newest) is unseen


def test_a_busy_worker_finds_tasks_whose_batch_came_and_went_unseen(tmp_path):
    """While a worker runs a task, a batch adds a task to a region whose task list it has cached,
    finishes, and a later submit deletes its marker: no listing of batches/ ever shows it to the
    worker as news. The pruned marker does: its `before` is later than anything the worker's last
    listing held, so a batch may have come and gone; the worker lists its cached regions again and
    claims the task at once, not at its last look (without that rule, or with the clock rule it
    replaced and a clock that stood still while the VM was suspended, it waited until then)."""
    keep = functools.partial(submit, batch_keep_s=1.0)
    store = LocalStore(tmp_path / "q")
    keep(store, b"{}", tasks("a0", "a1", "z0", "z1"), region_tasks=2)  # regions [a0, a1] and [z0, z1]
    held = [hold(store, t, "alive", ttl_s=30.0) for t in ("a1", "z0", "z1")]
    worker = Claimer(store, ClaimOptions(worker="w", seed=1, idle_timeout_s=30.0, poll_min_s=0.02, poll_max_s=0.1))
    walk = iter(worker)
    first = next(walk)
    assert first.task_id == "a0"
    claimed: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        for lease in held:
            stack.enter_context(renewing(lease))
        keep(store, None, tasks("a05"))  # into the region the busy worker has cached (no cut: a cut is news too)
        time.sleep(1.2)  # a05's done marker's age on the store's clock passes the keep time, so z5's submit prunes it
        keep(store, None, tasks("z5"))  # elsewhere; it deletes a05's done batch marker
        assert batch_name(["a05"]) not in {e.name for e in store.list(layout.BATCHES)}
        first.lease.complete([], time.monotonic())
        done_at = time.monotonic()
        for claim in walk:
            claimed[claim.task_id] = time.monotonic() - done_at
            claim.lease.complete([], time.monotonic())
            if len(claimed) == 2:
                worker.stop()
    assert sorted(claimed) == ["a05", "z5"]
    assert claimed["a05"] < 10.0, claimed  # long before its last look, 30 s on


class ComeAndGone(LocalStore):
    """A local queue in which, just before one chosen listing of batches/ is answered, a batch comes
    and goes unseen: submit A creates task `z` and finishes; a lifecycle rule moves the `updated`
    time of the older batch marker P (a storage class change: generation unchanged); then P's
    submit, whose machine paused after it wrote its `done` marker and before its prune, prunes A's
    marker as older than BATCH_KEEP_S. The listing after it holds the same markers at the same
    generations as one taken before A began: only layout.PRUNED says that a batch came and went
    (`layout.batch_unseen_between`, docs/PROTOCOL.md, "Status")."""

    def __init__(self, path, pruner: str, trigger) -> None:
        super().__init__(path)
        self.pruner, self.trigger = pruner, trigger
        self.listed: list[str] = []  # the prefixes the code under test listed (not the batch's own listings)
        self.happened = False
        self._inside = False

    def list_page(self, prefix, page_token=None, start_offset=None, page_size=1000, end_offset=None):
        if not self._inside:
            if not self.happened and prefix == layout.BATCHES and self.trigger(self.listed):
                self._come_and_go()
            self.listed.append(prefix)
        return super().list_page(prefix, page_token, start_offset, page_size, end_offset)

    def _come_and_go(self) -> None:
        self._inside = True
        try:
            submit(self, None, tasks("z"))
            (came,) = [e for e in self.list(layout.BATCHES) if e.name == batch_name(["z"])]
            path = self._meta_path(self._prefix + self.pruner)
            meta = json.loads(path.read_text())
            meta["updated"] = (came.updated + dt.timedelta(seconds=layout.BATCH_KEEP_S + 1)).isoformat()
            path.write_text(json.dumps(meta))
            assert prune_batches(self, self.pruner) == 1
            assert batch_name(["z"]) not in {e.name for e in self.list(layout.BATCHES)}
        finally:
            self._inside = False
        self.happened = True


def finished_queue(store) -> None:
    """Task `a`, submitted, run and swept: the queue is complete."""
    submit(store, b"{}", tasks("a"))
    assert drain(store) == ("drained", ["a"])


def test_status_is_not_complete_when_a_batch_came_and_went_between_its_two_listings_of_batches(tmp_path):
    """Status lists batches/, then the regions (the head region swept, one task), then batches/
    again; in between, a batch adds task `z` and is pruned. Both listings of batches/ hold the same
    markers: without the PRUNED rule, status said `complete`, 1 of 1 done, while `z` has no marker."""
    snapshots = 0

    def second_listing_of_a_snapshot(listed: list[str]) -> bool:
        return snapshots == 1 and listed.count(layout.BATCHES) == 1

    store = ComeAndGone(tmp_path / "q", batch_name(["a"]), second_listing_of_a_snapshot)
    finished_queue(store)
    store.listed.clear()
    snapshots = 1
    view = snapshot(store)
    assert store.happened
    assert not view["complete"], "status said complete while task z, of a batch that came and went, has no marker"
    assert (view["total"], view["done"]) == (2, 1)  # the retry counted z


def test_a_worker_is_not_drained_when_a_batch_came_and_went_between_its_two_listings_of_batches(tmp_path):
    """A worker on a swept queue lists batches/, the map and swept/, then batches/ again before it
    leaves `drained`; in between, a batch adds task `z` and is pruned. Without the PRUNED rule in
    `Claimer._drained` it left drained with `z` unrun (invariant 4)."""

    def drained_check_second_listing(listed: list[str]) -> bool:
        return listed[-3:] == [layout.BATCHES, layout.SPLITS, layout.SWEPT]  # _drained: batches/, the map, batches/

    store = ComeAndGone(tmp_path / "q", batch_name(["a"]), lambda listed: False)
    submit(store, b"{}", tasks("a"))
    store.listed.clear()
    store.trigger = drained_check_second_listing
    exit_reason, ran = drain(store)  # it runs `a`, sweeps the region, then checks whether it is drained
    assert store.happened
    assert ran == ["a", "z"], f"left {exit_reason!r} without running z, whose batch came and went"
    assert exit_reason == "drained"


# -- status says what blocks completion ---------------------------------------------------------


def test_status_names_what_blocks_completion_and_the_command_that_clears_it(tmp_path):
    store = LocalStore(tmp_path / "q")
    submit(store, b"{}", tasks("a", "b", "c"))
    bad = next(iter(Claimer(store, ClaimOptions(worker="w", seed=1))))
    bad.lease.dead_letter("consumer exit 65: bad input")
    silent = hold(store, "b" if bad.task_id != "b" else "c", "gone", ttl_s=0.1)  # a holder that died
    begin_batch(store, batch_name(["x"]), {"first": "x", "last": "x", "tasks": "1"})  # a submit that died
    view = snapshot(store, now=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=0.3))  # status looks 0.3 s on
    assert not view["complete"]
    kinds = {b["kind"]: b for b in view["blockers"]}
    assert set(kinds) == {"batch", "stale_lease", "dead_letter"}
    assert kinds["batch"]["batch"] == batch_id(batch_name(["x"])) and kinds["batch"]["tasks"] == 1
    assert f"--finish-batch {kinds['batch']['batch']}" in kinds["batch"]["clear"]
    assert kinds["stale_lease"]["task"] == silent.task_id and "spawn.py" in kinds["stale_lease"]["clear"]
    assert kinds["dead_letter"]["task"] == bad.task_id and "new id" in kinds["dead_letter"]["clear"]
    text = render(view)
    assert text.count("blocked ") == 3 and f"gcs-spawner submit {store.root_url} --finish-batch" in text
    assert json.loads(json.dumps(view))["blockers"] == view["blockers"]  # --json carries them
