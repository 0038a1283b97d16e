"""consume.py's command line: flags or SPAWN_* environment in, one extraction run, an exit code out.

Under spawn.py every input arrives as an environment variable; by hand the same inputs are
flags, and a flag wins over its variable. Without a progress file the run still writes shards
and logs each one.

Exit codes (the consumer contract, extract/errors.py): 0 done; 65 bad input (dead-lettered, never
retried); 75 transient I/O (retried); 70 any other failure (retried); 128+signal when stopped by
SIGTERM/SIGINT, after storing only complete shards. A run that has not exited STOP_GRACE_S
seconds after the signal (e.g. stuck in a compile) exits hard with the same code.

With SPAWN_RESIDENT=1 (`spawn.py --resident`) the process serves task after task, each from a request on its
standard input (extract/resident.py), and keeps the engine loaded between the tasks of one job.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from extract.errors import EX_DATAERR, EX_OK, EX_TEMPFAIL, BadInput, exit_code_for

log = logging.getLogger("extract.consume")

STOP_GRACE_S = 10.0

_FLAGS = (
    ("--job-file", "SPAWN_JOB_FILE", "job.json (docs/EXTRACTION.md)"),
    ("--task-file", "SPAWN_TASK_FILE", "task manifest JSON: {id, files: [{path, base, start, end}]}"),
    ("--output", "SPAWN_OUTPUT", "where shards go: a local directory or gs://bucket/prefix"),
    ("--resume-file", "SPAWN_RESUME_FILE", "committed progress: {task, attempt, progress: [records]}"),
    ("--progress-file", "SPAWN_PROGRESS_FILE", "file to append one JSON record per stored shard"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consume.py",
        description="Extract a language model's activations (hidden states, hook sites) for one task's slice of a "
        "dataset as safetensors shards. Models: GPT-2, Pythia (GPT-NeoX), Llama, Mistral, Qwen2/2.5/3, Phi-3, "
        "Phi-4-mini, OLMo 2, Gemma 1/2/3 (docs/MODEL.md).",
    )
    for flag, env, help_text in _FLAGS:
        parser.add_argument(flag, help=f"{help_text} (default: ${env})")
    parser.add_argument("--log-every", type=float, default=30.0, help="seconds between progress lines off a TTY")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return parser


def _setting(args: argparse.Namespace, flag: str, env: str) -> str | None:
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    return value if value else (os.environ.get(env) or None)


def _install_signal_handlers(stop) -> None:
    def hard_exit_later(signum: int) -> None:
        time.sleep(STOP_GRACE_S)
        log.error("event=stop_timeout signal=%d grace_s=%.0f: exiting without waiting further", signum, STOP_GRACE_S)
        _exit_without_teardown(128 + signum)

    def handler(signum: int, frame: object) -> None:
        if stop.is_set():
            os._exit(128 + signum)  # a second signal: the operator means it
        log.warning("event=signal signal=%d: stopping after complete shards", signum)
        threading.Thread(target=hard_exit_later, args=(signum,), name="stop-watchdog", daemon=True).start()
        stop.request(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def main(argv: Sequence[str] | None = None) -> int:
    from extract.phases import PhaseLedger

    phases = PhaseLedger()  # from the process's start: the interpreter and the imports count too
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s", force=True
    )
    from extract import resident
    from extract.consumer import StopRequest

    stop = StopRequest()
    _install_signal_handlers(stop)
    if resident.is_resident():
        return _serve(args, stop)
    paths = {flag: _setting(args, flag, env) for flag, env, _ in _FLAGS}
    return _run_task(paths, os.environ, args, stop, phases).exit_code


def _serve(args: argparse.Namespace, stop) -> int:
    """A resident consumer (extract/resident.py): every task of its worker in this process, the engine kept loaded
    between the tasks of one job."""
    from extract import resident
    from extract.consumer import Stopped, Warm
    from extract.phases import PhaseLedger, process_age_s

    given = [flag for flag, _, _ in _FLAGS if getattr(args, flag.lstrip("-").replace("-", "_"))]
    if given:
        log.error("event=usage error=%s is per task: a resident consumer takes it from each request", given[0])
        return 2
    replies = resident.take_stdout()
    warm = Warm()

    first = [True]

    def run_task(request: resident.Request) -> resident.Outcome:
        # The ledger starts at the claim. The first task's imports, devices and weights are this process's, and it
        # starts no later than the process did (the request waited in the pipe while the interpreter started); a
        # later task's start in `prepare`, unless its job needs another engine.
        started_at = request.claimed_at
        if first[0]:
            first[0] = False
            age = process_age_s()
            started_at = min(started_at, time.monotonic() - age) if age is not None else started_at
        phases = PhaseLedger(started_at=started_at, phase="imports" if warm.engine is None else "prepare")
        paths = {flag: request.env.get(env) for flag, env, _ in _FLAGS}
        return _run_task(paths, request.env, args, stop, phases, warm)

    try:
        return resident.serve(run_task, sys.stdin.buffer, replies)
    except Stopped as stopped:
        log.warning("event=stopped signal=%d between tasks", stopped.signum)
        return 128 + stopped.signum


def _run_task(paths: dict, env, args: argparse.Namespace, stop, phases, warm=None):
    """One task from its paths and per-task variables; its exit code, and whether the loaded state stays sound."""
    from extract import multihost, resident
    from extract.consumer import RunInputs, Stopped, run
    from extract.job import load_job, load_resume, load_task
    from extract.memory import DeviceMemoryError

    role = None
    try:
        for flag, variable, _ in _FLAGS[:3]:
            if not paths[flag]:
                raise BadInput(f"{flag.lstrip('-')}: not given; pass {flag} or set {variable}")
        job = load_job(paths["--job-file"])
        task = load_task(paths["--task-file"])
        attempt = env.get("SPAWN_ATTEMPT")
        task_id = env.get("SPAWN_TASK_ID")
        if task_id and task_id != task.id:
            raise BadInput(f"task.id: the task file says {task.id!r}, SPAWN_TASK_ID={task_id!r}; pass this task's file")
        role = multihost.role_from_env()
        if role is not None and warm is not None:
            # A resident host of a slice: its share in the program it joined for its first task, with the engine it
            # keeps. It serves on only after a task every host finished (they passed the same steps); after a
            # failure the hosts may stand at different steps, so each leaves and the next task starts them again.
            code = _run_share(role, job, task, paths, attempt, args, stop, warm)
            return resident.Outcome(code, stays=code == EX_OK)
        if role is not None or multihost.has_gaps(paths["--resume-file"], task):
            # A share of a slice's task, or a resume with gaps: its own engine, so this process does not stay.
            return resident.Outcome(_run_share(role or multihost.SliceRole.single(), job, task, paths, attempt, args,
                                               stop), stays=False)  # fmt: skip
        resume = load_resume(paths["--resume-file"], task)
        if attempt and attempt.isdigit():
            resume = dataclasses.replace(resume, attempt=int(attempt))
        inputs = RunInputs(
            job=job,
            task=task,
            output_url=paths["--output"],
            resume=resume,
            progress_path=paths["--progress-file"],
            log_every_s=args.log_every,
            phases=phases,
            compile_cache=True,
            warm=warm,
        )
        result = run(inputs, stop=stop)
        if result.stopped:
            return resident.Outcome(128 + (stop.signum or signal.SIGTERM), stays=False)
        return resident.Outcome(EX_OK, stays=True)
    except Stopped as stopped:
        log.warning("event=stopped signal=%d before the run loop", stopped.signum)
        return resident.Outcome(128 + stopped.signum, stays=False)
    except multihost.SliceFailed as failed:
        log.error("event=slice_failed exit=%d error=%s", failed.exit_code, failed)
        return resident.Outcome(failed.exit_code, stays=False)
    except Exception as exc:
        code = exit_code_for(exc)
        if code == EX_DATAERR:
            log.error("event=bad_input exit=%d error=%s", code, exc)
        elif code == EX_TEMPFAIL:
            log.error("event=transient_failure exit=%d error=%s", code, exc)
        else:
            log.exception("event=failure exit=%d error=%r", code, exc)
        # The task's own input (65) or the store (75) leave the loaded engine as it was; anything else (a bug, the
        # runtime, the device's memory) may not have. A slice's host leaves after any failure: one that failed alone
        # before the lockstep loop would leave the other hosts waiting at its first step, while its exit ends them.
        sound = code in (EX_DATAERR, EX_TEMPFAIL) and not isinstance(exc, DeviceMemoryError) and role is None
        return resident.Outcome(code, stays=sound)


def exit_now(code: int) -> None:
    """Leave with `code`, without the interpreter's teardown.

    By then every stored shard is recorded and the progress file is closed (the task's ledger ended with its last
    record). What is left is JAX's and XLA's teardown: 1 to 4 s on a loaded 2-core machine, outside every phase of
    the ledger, and paid by the worker, which waits for the exit before it writes the done marker (issue 44). A
    preempted spot VM has 30 s in all (https://cloud.google.com/compute/docs/instances/spot#preemption-process).
    Only a host of a multi-host slice that finished well leaves the slow way: `jax.distributed`'s shutdown at exit
    is the barrier its other hosts wait at.
    """
    if _distributed_teardown and code == EX_OK:
        sys.exit(code)
    _exit_without_teardown(code)


#: Set once this process joined a multi-host slice's JAX program (see exit_now).
_distributed_teardown = False


def _exit_without_teardown(code: int) -> None:
    """Flush the logs and the standard streams, then end the process at once (no atexit, no finalizers)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_share(role, job, task, paths, attempt, args, stop, warm=None) -> int:
    """This host's share of a task run by a whole slice (or a resume whose committed shards have gaps). With `warm`
    (a resident host of a slice) the process joins the slice's program once, keeps its engine and tokenizer, and
    returns every failure's exit code (its reply carries it) instead of leaving at once."""
    from extract import compilecache, multihost
    from extract.consumer import Stopped, load_engine, load_tokenizer

    global _distributed_teardown
    if multihost.initialize(role):
        # A per-task host leaves through jax.distributed's shutdown barrier (exit_now); a resident one leaves when
        # its worker does, at a time no other host waits for.
        _distributed_teardown = warm is None and role.process_count > 1
        compilecache.enable()  # after jax.distributed's set-up: it reads the devices
    elif role.process_count == 1:
        compilecache.enable()
    inputs = multihost.SliceInputs(
        job=job,
        task=task,
        output_url=paths["--output"],
        resume_path=paths["--resume-file"],
        progress_path=paths["--progress-file"],
        attempt=int(attempt) if attempt and attempt.isdigit() else None,
        log_every_s=args.log_every,
    )
    try:
        engine = tokenizer = None
        if warm is not None:
            if not warm.fits(job):
                warm.engine = warm.tokenizer = None  # drop another job's engine before loading this one's
                engine = load_engine(job)
                warm.keep(job, engine, compilecache.active(), load_tokenizer(engine, job))
            engine, tokenizer = warm.engine, warm.tokenizer
        result = multihost.run_share(inputs, role, stop, engine=engine, tokenizer=tokenizer)
    except BaseException as exc:
        if role.process_count == 1:
            raise
        if isinstance(exc, multihost.SliceFailed):
            code = exc.exit_code
        elif isinstance(exc, Stopped):
            code = 128 + exc.signum
        else:
            code = exit_code_for(exc)
        log.error("event=slice_failed exit=%d error=%r", code, exc)
        if warm is not None:
            return code  # the reply says it; the process then leaves without teardown (exit_now)
        # Leave at once: a normal exit would wait at jax.distributed's shutdown barrier for hosts that may
        # be dead, until the heartbeat timeout. The leader should learn of the failure now.
        _exit_without_teardown(code)
    if result.stopped:
        return 128 + (stop.signum or signal.SIGTERM)
    return EX_OK
