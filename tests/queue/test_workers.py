"""The claim protocol under real worker processes, real signals and a misbehaving transport."""

from __future__ import annotations

import datetime as dt
import json
import random
import re
import signal
import subprocess
import sys
import time

from objectstore import open_store
from taskqueue import layout
from tests.queue.conftest import assert_outputs_exact, submit_tasks
from tests.workers import REPO, lease_body, lease_holders, markers, wait_for


def test_eight_workers_finish_300_tasks_exactly_once(queue_url, workers):
    submit_tasks(queue_url, [{"id": f"t{k:04d}"} for k in range(300)])
    for w in range(8):
        workers.start(f"w{w}", consumer="true")
    assert set(workers.wait(timeout=240).values()) == {0}
    done = markers(queue_url, layout.DONE)
    assert sorted(done) == [f"t{k:04d}" for k in range(300)]
    assert markers(queue_url, layout.FAILED) == {}
    logs = workers.all_logs()
    assert len(re.findall(r"event=done task=", logs)) == 300
    assert "duplicate_completion" not in logs
    # Every lease stays as its task's `done` tombstone, so no later claim can create it again.
    leases = list(open_store(queue_url).list(layout.LEASES))
    assert len(leases) == 300 and {e.metadata["state"] for e in leases} == {"done"}


def test_sigkilled_workers_tasks_are_retaken_and_keep_exactly_committed_outputs(queue_url, workers):
    rng = random.Random(7)
    submit_tasks(queue_url, [{"id": f"k{k:02d}", "outputs": 4, "sleep": 0.2} for k in range(16)])
    flags = ("--lease-ttl", "1.5", "--heartbeat", "0.3", "--idle-timeout", "5")
    alive = [f"w{k}" for k in range(3)]
    for worker in alive:
        workers.start(worker, *flags)
    kills = 0
    deadline = time.monotonic() + 120
    while len(markers(queue_url, layout.DONE)) < 16 and time.monotonic() < deadline:
        time.sleep(rng.uniform(0.3, 0.8))  # a kill at a random moment of the run is what this test is about
        holders = sorted(set(alive) & lease_holders(queue_url))  # kill mid-task, so the lease must be stolen
        if kills < 4 and holders:
            victim = rng.choice(holders)
            workers.procs[victim].send_signal(signal.SIGKILL)
            workers.procs[victim].wait()
            alive.remove(victim)
            kills += 1
            replacement = f"r{kills}"
            workers.start(replacement, *flags)
            alive.append(replacement)
    for worker in alive:
        assert workers.procs[worker].wait(timeout=60) == 0
    done = markers(queue_url, layout.DONE)
    assert sorted(done) == [f"k{k:02d}" for k in range(16)]
    assert markers(queue_url, layout.FAILED) == {}
    assert_outputs_exact(queue_url, done, 4)
    assert "event=steal" in workers.all_logs()  # killed holders' leases were taken over after the TTL


def test_frozen_holder_cannot_commit_after_its_lease_is_stolen(queue_url, workers):
    submit_tasks(queue_url, [{"id": "z", "outputs": 8, "sleep": 0.4}])
    flags = ("--lease-ttl", "1.5", "--heartbeat", "0.3")
    zombie = workers.start("zombie", *flags)
    wait_for(lambda: (lease_body(queue_url, "z") or {}).get("progress"), 20, "a first committed output")
    zombie.send_signal(signal.SIGSTOP)  # its consumer runs on, but nothing the zombie does reaches storage
    try:
        workers.start("thief", *flags)
        wait_for(lambda: "event=steal task=z" in workers.log("thief"), 30, "the steal")
    finally:
        zombie.send_signal(signal.SIGCONT)
    assert workers.procs["thief"].wait(timeout=60) == 0
    assert zombie.wait(timeout=30) == 0
    thief_token = int(re.search(r"event=steal task=z token=(\d+)", workers.log("thief")).group(1))
    done = markers(queue_url, layout.DONE)
    assert done["z"]["fencing_token"] == thief_token and done["z"]["worker"] == "thief"
    assert_outputs_exact(queue_url, done, 8)
    zombie_log = workers.log("zombie")
    assert "event=lease_lost task=z" in zombie_log and "event=done" not in zombie_log
    # Whatever the zombie's consumer wrote after the steal stayed under its own token and counts for nothing.
    assert all(f"/out/z/{thief_token}/" in r["output"] or r["index"] < 8 for r in done["z"]["outputs"])


def _claim_tokens(log: str) -> list[int]:
    return [int(t) for t in re.findall(r"event=(?:claimed|steal|takeover) task=\S+ token=(\d+)", log)]


def test_fast_and_slow_clocks_neither_steal_live_leases_nor_block_expiry(local_queue_url, local_workers):
    url, workers = local_queue_url, local_workers
    submit_tasks(url, [{"id": "live", "outputs": 6, "sleep": 0.5}])
    flags = ("--lease-ttl", "1.2", "--heartbeat", "0.3", "--idle-timeout", "8")
    # A holder whose wall clock is two hours slow, watched by one two hours fast whose monotonic
    # clock also runs 1.5x: the live lease must survive.
    workers.start("slow", *flags, env={"SPAWN_CLOCK_SKEW_S": "-7200"})
    wait_for(lambda: lease_body(url, "live"), 10, "the claim")
    workers.start("fast", *flags, env={"SPAWN_CLOCK_SKEW_S": "7200", "SPAWN_CLOCK_RATE": "1.5"})
    assert workers.wait(timeout=60) == {"slow": 0, "fast": 0}
    done = markers(url, layout.DONE)
    assert done["live"]["worker"] == "slow" and done["live"]["attempt"] == 1
    assert "event=steal" not in workers.log("fast")

    # A dead holder with a fast clock, watched by a slow one: the lease is taken over after one TTL.
    submit_tasks(url, [{"id": "dead", "outputs": 2, "sleep": 3}])
    holder = workers.start("doomed", *flags, env={"SPAWN_CLOCK_SKEW_S": "7200"})
    wait_for(lambda: lease_body(url, "dead"), 10, "the claim")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    workers.start("heir", *flags, env={"SPAWN_CLOCK_SKEW_S": "-7200"})
    wait_for(lambda: "event=steal task=dead" in workers.log("heir"), 20, "the steal")
    # Timed from the heir's own start line, not from the kill: the heir's interpreter start is no part of the
    # rule, and on a loaded machine it took seconds (a round at a load of 20 saw 9.3 s from the kill).
    waited = logged_at(workers.log("heir"), "event=steal task=dead") - logged_at(workers.log("heir"), "event=start")
    assert 1.2 <= waited < 8, waited
    assert workers.procs["heir"].wait(timeout=60) == 0
    assert markers(url, layout.DONE)["dead"]["worker"] == "heir"


def logged_at(log: str, event: str) -> float:
    """When a worker logged its first line holding `event`, in seconds (taskqueue.cli.LOG_FORMAT's `asctime`)."""
    line = next(line for line in log.splitlines() if event in line)
    return dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_storms_of_503_and_429_fail_no_task(gcs, gcs_client, gcs_bucket, tmp_path):
    from tests.workers import Workers

    url = f"gs://{gcs_bucket}/jobs/storm"
    submit_tasks(url, [{"id": f"s{k:02d}", "outputs": 2} for k in range(30)])
    gcs.faults.fail_fraction(0.15, 503, seed=1)
    gcs.faults.fail_fraction(0.10, 429, seed=2)
    workers = Workers(url, tmp_path)
    try:
        for w in range(4):
            workers.start(f"w{w}", "--idle-timeout", "10")
        assert set(workers.wait(timeout=180).values()) == {0}
    finally:
        workers.kill_all()
        injected = gcs.counts()["faults_injected"]
        gcs.faults.reset()
    assert injected >= 30
    done = markers(url, layout.DONE)
    assert len(done) == 30 and markers(url, layout.FAILED) == {}
    assert_outputs_exact(url, done, 2)


def test_sigterm_releases_the_lease_within_10s_and_the_next_worker_resumes(queue_url, workers):
    submit_tasks(queue_url, [{"id": "p", "outputs": 12, "sleep": 0.3}])
    flags = ("--lease-ttl", "60", "--heartbeat", "0.3")
    first = workers.start("first", *flags)
    wait_for(lambda: len((lease_body(queue_url, "p") or {}).get("progress", [])) >= 2, 20, "two committed outputs")
    first.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    wait_for(lambda: (lease_body(queue_url, "p") or {}).get("state") == "released", 10, "the release")
    assert time.monotonic() - sent < 10
    assert first.wait(timeout=10) == 0
    body = lease_body(queue_url, "p")
    assert body["errors"] == [] and body["attempt"] == 1  # a stop is not an attempt
    committed = len(body["progress"])
    assert committed >= 2
    # With a 60 s TTL, only the release lets the next worker in at once; it resumes after the committed outputs.
    second = workers.start("second", *flags)
    wait_for(lambda: "event=takeover task=p" in workers.log("second"), 10, "an immediate takeover")
    assert f"committed={committed}" in workers.log("second")
    assert second.wait(timeout=60) == 0
    done = markers(queue_url, layout.DONE)
    assert_outputs_exact(queue_url, done, 12)
    assert done["p"]["attempt"] == 1


def test_ignored_sigterm_is_escalated_and_release_still_fits_in_10s(local_queue_url, local_workers):
    url, workers = local_queue_url, local_workers
    submit_tasks(url, [{"id": "stubborn", "outputs": 1, "sleep": 60, "ignore_term": True}])
    worker = workers.start("w", "--lease-ttl", "60", "--heartbeat", "1")
    wait_for(lambda: lease_body(url, "stubborn"), 10, "the claim")
    # On a loaded machine the consumer may take seconds to start; a SIGTERM before it ignores the
    # signal would simply end it, and there would be nothing to escalate.
    wait_for(lambda: "ignoring SIGTERM" in workers.log("w"), 60, "the consumer ignoring SIGTERM")
    worker.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    wait_for(lambda: (lease_body(url, "stubborn") or {}).get("state") == "released", 10, "the release")
    assert time.monotonic() - sent < 10
    assert worker.wait(timeout=5) == 0
    assert "consumer_kill" in workers.log("w")


def test_bad_manifests_and_exit_65_are_dead_lettered_while_the_worker_goes_on(queue_url, workers):
    submit_tasks(queue_url, [{"id": f"good{k}", "outputs": 1} for k in range(3)] + [{"id": "bad65", "exit": 65}])
    store = open_store(queue_url)
    store.create("tasks/badjson.json", b"{not json")
    store.create("tasks/noid.json", b'{"outputs": 1}')
    store.create("tasks/misnamed.json", b'{"id": "other"}')
    store.create("tasks/huge.json", json.dumps({"id": "huge", "pad": "x" * 70_000}).encode())
    workers.start("w")
    assert workers.wait(timeout=60) == {"w": 0}
    assert sorted(markers(queue_url, layout.DONE)) == ["good0", "good1", "good2"]
    failed = markers(queue_url, layout.FAILED)
    assert sorted(failed) == ["bad65", "badjson", "huge", "misnamed", "noid"]
    assert "exit 65" in failed["bad65"]["reason"] and "as told" in failed["bad65"]["errors"][0]["error"]
    assert "not valid JSON" in failed["badjson"]["reason"]
    assert "missing field 'id'" in failed["noid"]["reason"]
    assert "'other'" in failed["misnamed"]["reason"]
    assert "over the 65536-byte limit" in failed["huge"]["reason"]
    assert workers.log("w").count("consumer_start task=bad65") == 1  # dead-lettered at once, never retried
    # Every finished task leaves a tombstone lease, so that no stale view runs it again.
    states = {layout.id_from_object(e.name, layout.LEASES): json.loads(store.read(e.name).data)["state"]
              for e in store.list(layout.LEASES)}  # fmt: skip
    assert states == {**{t: "dead" for t in failed}, **{f"good{k}": "done" for k in range(3)}}


def test_failed_attempts_are_retried_then_dead_lettered_with_every_error(local_queue_url, local_workers):
    url, workers = local_queue_url, local_workers
    submit_tasks(url, [{"id": "flaky", "fail_attempts": 2}, {"id": "broken", "fail_attempts": 99}])
    workers.start("a", "--max-attempts", "3")
    workers.start("b", "--max-attempts", "3")
    assert set(workers.wait(timeout=60).values()) == {0}
    assert markers(url, layout.DONE)["flaky"]["attempt"] == 3
    letter = markers(url, layout.FAILED)["broken"]
    assert [e["attempt"] for e in letter["errors"]] == [1, 2, 3]
    assert all(e["exit_code"] == 1 and "failing attempt" in e["error"] for e in letter["errors"])


def test_a_job_with_no_task_is_never_drained_and_a_busy_queue_exits_after_the_idle_timeout(local_queue_url, local_workers):
    url, workers = local_queue_url, local_workers
    submit_tasks(url, [])  # job.json alone: nothing submitted (docs/PROTOCOL.md, "A queue is where its job is")
    started = time.monotonic()
    workers.start("empty", "--job-wait", "1")
    assert workers.wait(timeout=20) == {"empty": 65}
    assert time.monotonic() - started < 10 and f"no task at {open_store(url).root_url}" in workers.log("empty")
    assert "reason=drained" not in workers.log("empty") and not open_store(url).list_page("swept/").entries
    submit_tasks(url, [{"id": "long", "outputs": 1, "sleep": 12}])
    workers.start("holder", "--lease-ttl", "30", "--heartbeat", "0.5")
    wait_for(lambda: lease_body(url, "long"), 10, "the claim")
    started = time.monotonic()
    # It leaves idle once it has seen the holder's lease renew (a dead holder's would be taken over).
    idle = workers.start("idle", "--idle-timeout", "1", "--lease-ttl", "30", "--poll", "0.2")
    assert idle.wait(timeout=20) == 0
    assert 1 <= time.monotonic() - started < 6 and "reason=idle" in workers.log("idle")


def test_submit_is_idempotent_and_refuses_changed_tasks(tmp_path):
    url = str(tmp_path / "queue")
    (tmp_path / "queue").mkdir()  # a local queue is a directory that exists (objectstore/address.py)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{k}", "n": k}) + "\n" for k in range(5)))
    job = tmp_path / "job.json"
    job.write_text('{"name": "j"}')
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "tools/submit.py", url, "--job", str(job), "--tasks", str(tasks), "--any-consumer"],
        cwd=REPO, capture_output=True, text=True,
    )
    first, second = run(), run()
    assert "created=5 already_existed=0 job=created" in first.stdout
    assert "created=0 already_existed=5 job=existing" in second.stdout
    tasks.write_text(json.dumps({"id": "t1", "n": 100}) + "\n")
    changed = run()
    assert changed.returncode == 65 and "tasks/t1.json already exists with a different manifest" in changed.stderr
    tasks.write_text('{"id": "ok"}\n{"n": 1}\n')
    missing = run()
    assert missing.returncode == 65 and "tasks.jsonl:2: task is missing field 'id'" in missing.stderr


def test_status_counts_pending_leased_stale_done_and_failed(local_queue_url):
    url = local_queue_url
    submit_tasks(url, [{"id": f"t{k}"} for k in range(6)])
    store = open_store(url)
    store.create("done/t0.json", b"{}")
    store.create("failed/t1.json", json.dumps({"reason": "bad input: field 'text'"}).encode())
    lease = {"state": "held", "worker": "vm-7", "ttl_s": "60", "heartbeat_at": "x"}
    store.create("leases/t2.json", b"{}", metadata=lease)
    store.create("leases/t3.json", b"{}", metadata={**lease, "worker": "vm-9", "ttl_s": "0.2"})
    time.sleep(0.5)  # t3's lease (TTL 0.2 s) goes stale on the store's clock; status runs in its own process
    result = subprocess.run([sys.executable, "tools/status.py", url, "--json"], cwd=REPO, capture_output=True, text=True)
    view = json.loads(result.stdout)
    assert {k: view[k] for k in ("total", "pending", "leased", "stale", "done", "failed")} == {
        "total": 6, "pending": 2, "leased": 1, "stale": 1, "done": 1, "failed": 1,
    }
    assert view["holders"] == {"vm-7": 1}
    assert view["stale_leases"][0]["worker"] == "vm-9"
    assert view["failed_reasons"] == {"t1": "bad input: field 'text'"}
    text = subprocess.run([sys.executable, "tools/status.py", url], cwd=REPO, capture_output=True, text=True).stdout
    assert "stale   t3 held by vm-9" in text and "failed  x1 bad input: field 'text' | t1" in text


def test_a_task_whose_holders_keep_dying_is_dead_lettered(local_queue_url, local_workers):
    from taskqueue.clock import Clock
    from taskqueue.lease import encode, new_lease_body
    from taskqueue.spawner import MAX_TAKEOVERS

    url, workers = local_queue_url, local_workers
    submit_tasks(url, [{"id": "poison"}, {"id": "fine"}])
    # The lease as the tenth dead holder left it: held, and about to expire again.
    body = new_lease_body("poison", "dead-vm", 0.5, Clock())
    body["takeovers"] = MAX_TAKEOVERS - 1
    data, metadata = encode(body)
    open_store(url).create(layout.lease_object("poison"), data, metadata=metadata)
    workers.start("w", "--idle-timeout", "5")
    assert workers.wait(timeout=30) == {"w": 0}
    assert "expired 10 times" in markers(url, layout.FAILED)["poison"]["reason"]
    assert "consumer_start task=poison" not in workers.log("w")
    assert list(markers(url, layout.DONE)) == ["fine"]
