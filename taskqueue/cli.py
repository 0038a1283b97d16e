"""Command-line parsing and logging set-up for the worker; `spawn.py` composes it with the cloud hooks."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shlex
import signal
import socket
import sys
from collections.abc import Callable

from exitcodes import EX_DATAERR
from objectstore import open_store
from objectstore.denied import permission_denied
from taskqueue.claims import default_poll_max
from taskqueue.clock import Clock
from taskqueue.completion import QueueMissing, dead_letters_note
from taskqueue.slice import Follower, SliceOptions
from taskqueue.spawner import SpawnOptions, Spawner, resolve_consumer

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=LOG_FORMAT, stream=sys.stderr)
    # The client libraries log every retry at WARNING; ours already say the same in one line.
    logging.getLogger("google").setLevel(logging.ERROR)
    logging.getLogger("urllib3").setLevel(logging.ERROR)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spawn.py",
        description="Claim tasks from a queue (gs://bucket/prefix or a local directory), run the consumer on each, "
        "mark them done, and exit when no work is left. See docs/PROTOCOL.md.",
    )
    p.add_argument("queue", help="gs://bucket/prefix or a local directory")
    p.add_argument("--consumer", required=True, help="command run for each task, e.g. 'python consume.py'")
    p.add_argument(
        "--resident", action="store_true",
        help="run one consumer process for every task, its model kept loaded between tasks (it must speak the "
        "resident protocol, as consume.py does: docs/PROTOCOL.md, 'Resident consumers'); on a slice, set on its "
        "leader: the followers do as the leader does",
    )  # fmt: skip
    p.add_argument("--worker-id", default=None, help="name in leases and logs (default: host-pid-random)")
    p.add_argument("--lease-ttl", type=float, default=120.0, help="seconds a silent lease lives (default 120)")
    p.add_argument("--heartbeat", type=float, default=None, help="seconds between renewals (default TTL/4)")
    p.add_argument("--max-attempts", type=int, default=3, help="failed attempts before a task is dead-lettered")
    p.add_argument("--max-tasks", type=int, default=None, help="exit after this many tasks")
    p.add_argument("--idle-timeout", type=float, default=300.0, help="seconds to wait for leased work before exiting")
    p.add_argument(
        "--job-wait", type=float, default=60.0, metavar="SECONDS",
        help="seconds to wait for the queue's job.json and a first task before calling the queue URL wrong: "
        "record failed, exit 65 (default 60; docs/PROTOCOL.md, 'A queue is where its job is')",
    )  # fmt: skip
    p.add_argument(
        "--stuck-after", type=float, default=None, metavar="SECONDS",
        help="stop a consumer that wrote no progress record and no output line for this long; the attempt "
        "counts as failed (default: never)",
    )  # fmt: skip
    p.add_argument(
        "--max-task-time", type=float, default=None, metavar="SECONDS",
        help="stop a consumer that has run this long in all; the attempt counts as failed (default: no limit)",
    )  # fmt: skip
    p.add_argument(
        "--poll", type=float, default=1.0,
        help="shortest wait between polls of a busy queue (seconds; the first is at least an eighth of the longest)",
    )
    p.add_argument(
        "--on-empty", choices=("exit", "delete", "delete-when-drained"), default="exit",
        help="delete this machine when the queue is drained or idle (delete), or only once it is drained "
        "(delete-when-drained: for a multislice, whose deletion takes every slice along)",
    )  # fmt: skip
    p.add_argument(
        "--preemption-watch",
        choices=("auto", "on", "off"),
        default="auto",
        help="watch the metadata server for preemption (auto: when on Google Cloud)",
    )
    p.add_argument(
        "--machine-record",
        choices=("auto", "on", "off"),
        default="auto",
        help="write this machine's state to machines/<name>.json in the queue (auto: when on Google Cloud)",
    )
    p.add_argument("--log-level", default=os.environ.get("SPAWN_LOG_LEVEL", "INFO"))
    multi = p.add_argument_group("multi-host slice", "set on every host of a multi-host TPU slice (docs/PROTOCOL.md, Slices)")
    multi.add_argument("--slice-id", default=None, help="the slice's name, shared by its hosts")
    multi.add_argument("--slice-hosts", type=int, default=1, help="hosts in the slice (1: an ordinary worker)")
    multi.add_argument("--host-index", type=int, default=0, help="this host's index; 0 leads, the others follow")
    multi.add_argument("--coordinator", default=None, help="ADDRESS:PORT of host 0's JAX coordination service")
    multi.add_argument(
        "--slice-heartbeat-timeout", type=int, default=None,
        help="seconds without a heartbeat before the slice's JAX program declares a host dead (consumer default 30)",
    )  # fmt: skip
    return p


def slice_options(args: argparse.Namespace) -> SliceOptions | None:
    if args.slice_hosts <= 1:
        return None
    if not args.slice_id or not args.coordinator:
        raise ValueError("--slice-hosts > 1 needs --slice-id and --coordinator (fleet/service.py passes them)")
    return SliceOptions(
        slice_id=args.slice_id,
        hosts=args.slice_hosts,
        host_index=args.host_index,
        coordinator=args.coordinator,
        heartbeat_timeout_s=args.slice_heartbeat_timeout,
    )


def build(argv: list[str] | None = None) -> tuple[argparse.Namespace, Spawner | Follower]:
    """A Spawner, or on a slice's follower host a Follower (it claims nothing)."""
    args = parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        role = slice_options(args)
        if role is not None and not role.is_leader:
            heartbeat = args.heartbeat if args.heartbeat is not None else args.lease_ttl / 4
            follower = Follower(
                open_store(args.queue),
                role,
                resolve_consumer(shlex.split(args.consumer)),
                args.worker_id or default_worker_id(),
                # The leader may wait up to its own idle timeout for leased work, then closes the slice;
                # a follower gives up only when no leader has spoken for well past that.
                idle_timeout_s=2 * args.idle_timeout + 60,
                poll_s=max(args.poll, 0.05),
                watch_s=min(5.0, heartbeat / 2),
                clock=Clock.from_env(),
            )
            return args, follower
        options = SpawnOptions(
            consumer=resolve_consumer(shlex.split(args.consumer)),
            worker=args.worker_id or default_worker_id(),
            lease_ttl_s=args.lease_ttl,
            heartbeat_s=args.heartbeat if args.heartbeat is not None else args.lease_ttl / 4,
            max_attempts=args.max_attempts,
            max_tasks=args.max_tasks,
            idle_timeout_s=args.idle_timeout,
            poll_min_s=args.poll,
            poll_max_s=default_poll_max(args.poll, args.lease_ttl),
            slice=role,
            stuck_after_s=args.stuck_after,
            max_task_s=args.max_task_time,
            job_wait_s=args.job_wait,
            resident=args.resident,
        )
    except ValueError as exc:
        parser().error(str(exc))
    return args, Spawner(open_store(args.queue), options, Clock.from_env())


def install_stop_signals(spawner: Spawner | Follower) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda s, _frame: spawner.request_stop(signal.Signals(s).name))


def run(
    argv: list[str] | None = None,
    self_delete: Callable[[], None] | None = None,
    watch_preemption: Callable[[Callable[[], None], bool], object | None] | None = None,
    machine_state: Callable[[object, bool], Callable[..., None] | None] | None = None,
) -> int:
    """Parse, run until the queue is empty or a stop, then delete the machine if asked to.

    `watch_preemption(on_preempted, required)` starts a watcher (or returns None when not on a
    cloud machine and not required); `self_delete()` is the `--on-empty delete` hook;
    `machine_state(store, required)` returns the `on_state(state, **fields)` hook that records this
    machine's state (or None when not on a cloud machine and not required).
    """
    args, spawner = build(argv)
    install_stop_signals(spawner)
    # A slice's follower claims nothing, so its leader's record speaks for the slice's work; but startup.sh wrote
    # this host's own record too (NODE-wN), which must not stay `installing` forever: a follower says it follows
    # (idle, role follower) and, when it stops following, how it ended (exited, with its reason).
    on_state = None
    if args.machine_record != "off" and machine_state is not None:
        on_state = machine_state(spawner.store, args.machine_record == "on")
        if isinstance(spawner, Spawner):
            spawner.on_state = on_state
        elif on_state is not None:
            on_state("idle", role="follower")
    watcher = None
    if args.preemption_watch != "off" and watch_preemption is not None:
        watcher = watch_preemption(lambda: spawner.request_stop("preempted"), args.preemption_watch == "on")
    try:
        reason = spawner.run()
    except QueueMissing as err:
        return _no_queue(spawner, err, args.on_empty != "exit", self_delete)
    except Exception as err:  # a 403 is one line, not a traceback and a restart into the same refusal
        denied = permission_denied(err, spawner.store.root_url)
        if denied is None:
            raise
        return _refused(spawner, denied, args.on_empty != "exit", self_delete)
    finally:
        if watcher is not None:
            watcher.stop()
    if isinstance(spawner, Follower):
        if on_state is not None:
            on_state("exited", reason=f"follower {reason}", role="follower")
        return 0  # a slice deletes itself once, from its leader: never from a follower
    if (reason in ("drained", "idle") and args.on_empty == "delete") or (
        reason == "drained" and args.on_empty == "delete-when-drained"
    ):
        if self_delete is None:
            raise SystemExit("--on-empty delete: this build has no self-delete hook")
        note = dead_letters_note(spawner.store) if reason == "drained" else ""
        spawner.tell_state("deleting", reason=f"queue {reason}{note}")
        self_delete()
    else:
        # A preempted machine says so at once: status counts it out of the fleet up (reporting/machinestate.py).
        if reason == "stopped" and spawner.stop_reason:
            reason = "preempted" if spawner.stop_reason == "preempted" else f"stopped ({spawner.stop_reason})"
        note = dead_letters_note(spawner.store) if reason == "drained" else ""
        spawner.tell_state("exited", reason=reason + note)
    return 0


def _refused(spawner: Spawner, denied: str, delete: bool, self_delete: Callable[[], None] | None) -> int:
    """The store refused this machine's service account (objectstore.denied): as `_no_queue`, one
    line naming the permission, the object and the account, the record `failed` with it (if the
    store takes that write), the machine deleted under --on-empty delete, and exit 65, which its
    unit does not restart: a restart would meet the same refusal."""
    logging.getLogger("taskqueue.cli").error("event=permission_denied queue=%s reason=%r", spawner.store.root_url, denied)
    print(f"spawn.py: {denied}", file=sys.stderr)
    spawner.tell_state("failed", reason=denied)
    if delete and self_delete is not None:
        self_delete()
    return EX_DATAERR


def _no_queue(spawner: Spawner, err: QueueMissing, delete: bool, self_delete: Callable[[], None] | None) -> int:
    """The queue URL names no queue: one line naming it (no traceback), the machine record `failed`
    with that line (where the bucket exists: the record lives in the queue prefix, the one object
    written there), and with --on-empty delete the machine deletes itself, so a fleet launched at a
    typo stops costing money with its reason on record. Exit 65: a restart would find the same."""
    logging.getLogger("taskqueue.cli").error("event=no_queue queue=%s reason=%r", spawner.store.root_url, str(err))
    print(f"spawn.py: {err}", file=sys.stderr)
    spawner.tell_state("failed", reason=str(err))
    if delete and self_delete is not None:
        self_delete()
    return EX_DATAERR  # the queue URL names no queue (no job.json, no bucket): bad input
