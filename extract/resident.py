"""The consumer's side of the resident protocol: one process serving its worker's tasks one after another.

A per-task consumer is a fresh process for each task, and pays its imports, devices, weights and programs every
time. A resident consumer (`spawn.py --resident`, docs/PROTOCOL.md, "Resident consumers") is started once and
keeps them loaded. The worker writes one request line per task on its standard input and reads one reply line
per task from its standard output:

    request  {"task": "<id>", "env": {"SPAWN_TASK_FILE": ..., ...}, "waited_s": 0.12}
    reply    {"task": "<id>", "exit_code": 0, "stays": true}

`env` holds exactly the per-task variables a per-task consumer gets (docs/PROTOCOL.md, "The consumer contract");
`waited_s` is how long ago the worker claimed the task, so that the task's ledger starts at its claim.
`exit_code` means what a per-task consumer's exit code means. `stays` is false when this process leaves after the
reply (a stop, or a failure that leaves its loaded state suspect); it then exits with the same code.

The replies travel on the process's original standard output; file descriptor 1 is pointed at standard error
before anything runs, so a stray `print` in a library lands in the log instead of in the protocol.

End of input (the worker closed the pipe: it is leaving) ends the process with 0. No JAX and no queue here:
`extract.cli` supplies the task runner, tests supply their own.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import IO, NamedTuple

from jsonline import parse_object

log = logging.getLogger(__name__)

#: The environment variable a worker sets on a consumer it runs resident.
ENV = "SPAWN_RESIDENT"
#: The per-task variables a request may carry (the consumer contract's).
TASK_VARIABLES = frozenset({
    "SPAWN_TASK_FILE", "SPAWN_JOB_FILE", "SPAWN_RESUME_FILE", "SPAWN_PROGRESS_FILE", "SPAWN_TASK_ID",
    "SPAWN_ATTEMPT", "SPAWN_OUTPUT",
})  # fmt: skip
#: A request line longer than this is the worker's bug, not a task's.
MAX_REQUEST = 1 << 20
#: The exit code when the worker wrote something that is not a request (its bug, not the task's: 70, as any other
#: failure; the worker restarts the consumer for its next task).
EX_PROTOCOL = 70


class Request(NamedTuple):
    task: str
    env: dict[str, str]
    claimed_at: float  # on time.monotonic(): when the worker claimed the task


class Outcome(NamedTuple):
    exit_code: int
    stays: bool  # this process serves another task (its loaded state is sound)


class ProtocolError(ValueError):
    """A request line that does not follow docs/PROTOCOL.md, "Resident consumers"."""


def is_resident(env: Mapping[str, str] | None = None) -> bool:
    return ((os.environ if env is None else env).get(ENV) or "").strip() == "1"


def parse_request(line: bytes | str, now: float) -> Request:
    """One request line; raises ProtocolError naming the field at fault."""
    body = parse_object(line, MAX_REQUEST, "request", ProtocolError)
    task, env, waited = body.get("task"), body.get("env"), body.get("waited_s", 0.0)
    if not isinstance(task, str) or not task:
        raise ProtocolError(f"request.task: a task id string is needed, got {task!r}")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ProtocolError("request.env: an object of strings is needed (the per-task SPAWN_* variables)")
    unknown = sorted(set(env) - TASK_VARIABLES)
    if unknown:
        raise ProtocolError(f"request.env: {', '.join(unknown)} is not a per-task variable of the consumer contract")
    if not isinstance(waited, (int, float)) or isinstance(waited, bool) or not 0 <= waited < 86400:
        raise ProtocolError(f"request.waited_s: seconds since the claim (0 to 86400) are needed, got {waited!r}")
    return Request(task, env, now - float(waited))


def reply_line(task: str, outcome: Outcome) -> bytes:
    return (json.dumps({"task": task, "exit_code": outcome.exit_code, "stays": outcome.stays}) + "\n").encode()


def take_stdout() -> IO[bytes]:
    """The replies' channel: the process's standard output as it started; fd 1 now goes to standard error."""
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    sys.stdout.flush()
    os.dup2(2, 1)
    return replies


def serve(run_task: Callable[[Request], Outcome], requests: IO[bytes], replies: IO[bytes]) -> int:
    """Run each request's task with `run_task` and reply, until end of input (0) or an outcome that does not stay
    (its exit code). `run_task` maps every failure of the task to an outcome; what it raises (a stop between
    tasks, a bug) ends the process as it would end a per-task consumer."""
    served = 0
    while True:
        line = requests.readline()
        if not line:
            log.info("event=resident_exit reason=end_of_input tasks=%d", served)
            return 0
        try:
            request = parse_request(line, time.monotonic())
        except ProtocolError as exc:
            log.error("event=resident_protocol_error error=%s", exc)
            return EX_PROTOCOL
        log.info("event=resident_task task=%s served=%d", request.task, served)
        outcome = run_task(request)
        served += 1
        replies.write(reply_line(request.task, outcome))
        if not outcome.stays:
            log.info("event=resident_exit reason=not_sound task=%s exit_code=%d tasks=%d", request.task,
                     outcome.exit_code, served)  # fmt: skip
            return outcome.exit_code
