"""A simulated 2-host slice end to end: real spawn.py leader and follower, each running consume.py as one of two
JAX processes (2 CPU devices each), against a local-directory queue."""

from __future__ import annotations

import json
import os
import re
import signal
import time

from objectstore import open_store
from taskqueue import layout
from taskqueue.slice import assignment_object
from taskqueue.submit import submit
from tests.slice.conftest import ALL_ROWS, HOST_XLA_FLAGS, assert_same_samples, samples_by_id, slice_job
from tests.workers import Workers, lease_body, markers, wait_for

CONSUMER = "python consume.py"


def split_job(tiny_models, corpus, **overrides) -> dict:
    # The model is split over all 4 devices, so across both processes (tensor parallel across hosts).
    return slice_job(tiny_models, corpus, mesh="model=4", **overrides)


def make_queue(path, job: dict, task: dict) -> str:
    url = str(path)
    report = submit(open_store(url), json.dumps(job).encode(), [(task["id"], json.dumps(task).encode())])
    assert report is not None
    return url


def start_host(workers: Workers, name: str, index: int, coordinator: str, env: dict, *flags: str):
    return workers.start(
        name, "--slice-id", "s1", "--slice-hosts", "2", "--host-index", str(index), "--coordinator", coordinator,
        "--slice-heartbeat-timeout", "5", *flags, consumer=CONSUMER, env={**env, "XLA_FLAGS": HOST_XLA_FLAGS},
    )  # fmt: skip


def committed(url: str, task_id: str) -> dict:
    return samples_by_id(str(open_store(url).url(layout.done_object(task_id))))


def consumer_pid(log: str, after: int = 0) -> int:
    pids = re.findall(r"event=(?:follower_)?consumer_start task=\S+ (?:token=\S+ )?pid=(\d+)", log)
    return int(pids[after])


def test_slice_claims_as_one_worker_and_completes_like_one_process(
    tmp_path, tiny_models, corpus, consume_env, coordinator, reference
):
    task = {"id": "t000000", "files": corpus.slice_files(ALL_ROWS)}
    url = make_queue(tmp_path / "queue", split_job(tiny_models, corpus), task)
    workers = Workers(url, tmp_path)
    try:
        start_host(workers, "leader", 0, coordinator, consume_env())
        start_host(workers, "follower", 1, coordinator, consume_env())
        codes = workers.wait(timeout=240)
    finally:
        workers.kill_all()
    assert codes == {"leader": 0, "follower": 0}, workers.all_logs()[-5000:]
    done = markers(url, layout.DONE)["t000000"]
    assert done["worker"] == "leader" and done["attempt"] == 1
    assert_same_samples(committed(url, "t000000"), reference)
    # The follower wrote shards of its own under the leader's fenced prefix; it claimed nothing.
    prefix = f"/out/t000000/{done['fencing_token']}/"
    assert all(prefix in record["shard"] for record in done["outputs"])
    assert "event=follower_consumer_start task=t000000" in workers.log("follower")
    assert "event=claim" not in workers.log("follower")
    board = json.loads(open_store(url).read(assignment_object("s1")).data)
    assert board["state"] == "closed" and board["hosts"] == 2 and board["leader"] == "leader"
    assert "event=follower_exit worker=follower reason=leader_exit" in workers.log("follower")


def test_follower_killed_mid_task_fails_the_attempt_in_bounded_time_and_a_retry_completes(
    tmp_path, tiny_models, corpus, consume_env, coordinator, reference
):
    task = {"id": "t000000", "files": corpus.slice_files(ALL_ROWS)}
    url = make_queue(tmp_path / "queue", split_job(tiny_models, corpus, shard_size=4, batch_size=2), task)
    workers = Workers(url, tmp_path)
    try:
        start_host(workers, "leader", 0, coordinator, consume_env(), "--lease-ttl", "6", "--heartbeat", "0.5",
                   "--idle-timeout", "120")  # fmt: skip
        start_host(workers, "follower", 1, coordinator, consume_env(), "--lease-ttl", "6", "--heartbeat", "0.5")
        # Mid-task: the leader's lease has committed shards (of both hosts), and the task is not done.
        wait_for(lambda: len((lease_body(url, "t000000") or {}).get("progress", [])) >= 2, 180, "committed shards")
        follower_consumer = consumer_pid(workers.log("follower"))
        killed_at = time.monotonic()
        workers.procs["follower"].send_signal(signal.SIGKILL)  # the host dies: its worker and its consumer
        os.killpg(follower_consumer, signal.SIGKILL)
        wait_for(lambda: (lease_body(url, "t000000") or {}).get("errors"), 60, "the failed attempt recorded")
        noticed_s = time.monotonic() - killed_at
        errors = lease_body(url, "t000000")["errors"]
        assert errors[0]["attempt"] == 1 and errors[0]["exit_code"] != 0
        assert noticed_s < 5 + 10, noticed_s  # heartbeat timeout + one lease write, with slack for 2 busy cores
        assert not markers(url, layout.DONE)
        # The host comes back (systemd restarts spawn.py): the retried task completes.
        start_host(workers, "follower-2", 1, coordinator, consume_env(), "--lease-ttl", "6", "--heartbeat", "0.5")
        wait_for(lambda: markers(url, layout.DONE), 180, "the done marker")
    finally:
        workers.kill_all()
    done = markers(url, layout.DONE)["t000000"]
    assert done["attempt"] == 2
    tokens = {r["shard"].split("/out/t000000/")[1].split("/")[0] for r in done["outputs"]}
    assert len(tokens) == 2  # shards committed by attempt 1 were kept, the rest came from attempt 2
    assert_same_samples(committed(url, "t000000"), reference)
    print(f"figure: slice noticed the dead follower after {noticed_s:.1f}s")


def test_leader_killed_lets_another_worker_take_over_and_the_follower_stops(
    tmp_path, tiny_models, corpus, consume_env, coordinator
):
    task = {"id": "t000000", "files": corpus.slice_files(ALL_ROWS)}
    url = make_queue(tmp_path / "queue", split_job(tiny_models, corpus, shard_size=4, batch_size=2), task)
    workers = Workers(url, tmp_path)
    try:
        start_host(workers, "leader", 0, coordinator, consume_env(), "--lease-ttl", "4", "--heartbeat", "0.5")
        start_host(workers, "follower", 1, coordinator, consume_env(), "--lease-ttl", "4", "--heartbeat", "0.5")
        # Mid-task: both processes have joined the JAX program and know their shares.
        wait_for(lambda: "event=share " in workers.log("follower"), 120, "the follower's consumer")
        leader_consumer = consumer_pid(workers.log("leader"))
        workers.procs["leader"].send_signal(signal.SIGKILL)
        os.killpg(leader_consumer, signal.SIGKILL)
        # Another worker (an ordinary one, with a consumer that does nothing) steals the expired lease.
        workers.start("other", "--lease-ttl", "4", "--idle-timeout", "60", consumer="python -c pass", env=consume_env())
        wait_for(lambda: "event=follower_stop " in workers.log("follower")
                 or "event=follower_consumer_exit" in workers.log("follower"), 60, "the follower's consumer stopping")
        wait_for(lambda: markers(url, layout.DONE), 60, "the other worker's done marker")
    finally:
        workers.kill_all()
    assert markers(url, layout.DONE)["t000000"]["worker"] == "other"
    follower_log = workers.log("follower")
    assert follower_log.count("event=follower_consumer_start") == 1  # it never ran a task the leader did not hold


def test_resident_slice_serves_task_after_task_and_a_killed_follower_costs_one_attempt(
    tmp_path, tiny_models, corpus, consume_env, coordinator, reference
):
    # The corpus as three tasks. Each host's resident consume.py joins the slice's JAX program once and serves every
    # task in it; a follower host killed mid-task fails that attempt on every host in bounded time, and the retry
    # starts both hosts' consumers again (a new program).
    tasks = [{"id": f"t{k}", "files": corpus.slice_files([rows])} for k, rows in enumerate(ALL_ROWS)]
    url = str(tmp_path / "queue")
    job = split_job(tiny_models, corpus, shard_size=4, batch_size=2)
    assert submit(open_store(url), json.dumps(job).encode(), [(t["id"], json.dumps(t).encode()) for t in tasks])
    workers = Workers(url, tmp_path)
    fast = ("--resident", "--lease-ttl", "6", "--heartbeat", "0.5")
    try:
        start_host(workers, "leader", 0, coordinator, consume_env(), *fast, "--idle-timeout", "120")
        start_host(workers, "follower", 1, coordinator, consume_env(), *fast)
        wait_for(lambda: markers(url, layout.DONE), 180, "a first task done by the resident slice")
        first = next(iter(markers(url, layout.DONE)))

        def working() -> str | None:  # the task the slice works on, once it has committed shards
            board = json.loads(open_store(url).read(assignment_object("s1")).data)
            task = board.get("task") if board["state"] == "assigned" else None
            return task if task and task not in markers(url, layout.DONE) and len(
                (lease_body(url, task) or {}).get("progress", [])) >= 2 else None  # fmt: skip

        killed_task = wait_for(working, 180, "a second task mid-way")
        follower_log = workers.log("follower")
        follower_consumer = int(re.findall(r"event=follower_resident_start pid=(\d+)", follower_log)[-1])
        killed_at = time.monotonic()
        workers.procs["follower"].send_signal(signal.SIGKILL)  # the host dies: its worker and its consumer
        os.killpg(follower_consumer, signal.SIGKILL)
        wait_for(lambda: (lease_body(url, killed_task) or {}).get("errors"), 60, "the failed attempt recorded")
        noticed_s = time.monotonic() - killed_at
        assert noticed_s < 5 + 10, noticed_s  # the JAX heartbeat timeout + one lease write, with slack for 2 cores
        start_host(workers, "follower-2", 1, coordinator, consume_env(), *fast)
        wait_for(lambda: len(markers(url, layout.DONE)) == 3, 240, "every task done")
    finally:
        workers.kill_all()
    done = markers(url, layout.DONE)
    assert done[killed_task]["attempt"] == 2 and done[killed_task]["worker"] == "leader"
    assert [e["attempt"] for e in lease_body(url, killed_task)["errors"]] == [1]
    # Before the kill: one consumer per host served the tasks in one program; after it, one new one per host.
    leader = workers.log("leader")
    assert leader.count("event=resident_start") == 2, leader[-3000:]
    assert follower_log.count("event=follower_resident_start") == 1
    assert re.search(rf"event=follower_consumer_start task={first} .* program=leader\.1", follower_log)
    assert re.search(rf"event=follower_consumer_start task={killed_task} .* program=leader\.1", follower_log)
    assert "program=leader.2" in workers.log("follower-2")
    assert leader.count("event=slice_joined") == 2  # once per program, not once per task
    committed_samples: dict = {}
    for task_id in done:
        committed_samples.update(committed(url, task_id))
    assert_same_samples(committed_samples, reference)
    print(f"figure: resident slice noticed the dead follower after {noticed_s:.1f}s")
