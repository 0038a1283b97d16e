"""Our retry loop and the ambiguous conditional write, apart from any client library.

`objectstore.gcs` runs every request through `Retrier.call` and every conditional write through
`write_with_nonce`; the deterministic simulation (`tests/simworld`) runs its simulated requests
through the very same two, on virtual time and a seeded random source, so the rule below is tested
exactly as it runs in production.

**The ambiguous-write rule.** Retries are ours (the client's own are off), because only then do we
know whether a request reached the wire more than once. A conditional write whose first attempt was
applied but whose response was lost comes back as 412 on the retry. A 412 after a retry is therefore
read back, and the write is ours exactly when the object carries the nonce this call put in its
custom metadata. A 412 on the first attempt is unambiguous.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from objectstore.base import NotFound, PreconditionFailed, StoreUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Full-jitter exponential backoff: sleep uniform(0, min(cap, initial * 2**n)), for at most `deadline_s`."""

    initial_s: float = 0.1
    cap_s: float = 8.0
    deadline_s: float = 120.0
    timeout_s: float = 60.0  # per HTTP request


class Attempts:
    """Counts how many times one logical call reached the wire."""

    def __init__(self) -> None:
        self.count = 0

    @property
    def retried(self) -> bool:
        return self.count > 1


class Retrier:
    """Calls a request until it succeeds, fails for good, or transient failures outlast the deadline.

    `is_transient(exc)` says which exceptions are worth another try; any other propagates as it is
    (the caller maps 404 and 412 to NotFound and PreconditionFailed inside the request). Transient
    failures past the deadline raise StoreUnavailable naming the call.
    """

    def __init__(
        self,
        policy: RetryPolicy,
        is_transient: Callable[[BaseException], bool],
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ):
        self.policy = policy
        self.is_transient = is_transient
        self.sleep = sleep
        self.monotonic = monotonic
        self.rng = rng or random.Random()

    def call(self, what: str, request: Callable[[], T], attempts: Attempts | None = None) -> T:
        attempts = attempts if attempts is not None else Attempts()
        policy = self.policy
        started = self.monotonic()
        while True:
            attempts.count += 1
            try:
                return request()
            except Exception as exc:
                if not self.is_transient(exc):
                    raise
                if self.monotonic() - started >= policy.deadline_s:
                    raise StoreUnavailable(
                        f"{what}: still failing after {attempts.count} attempts over {policy.deadline_s:.0f}s: {exc}"
                    ) from exc
                log.warning("event=store_retry call=%s attempt=%d error=%r", what, attempts.count, exc)
                self.sleep(self.rng.uniform(0, min(policy.cap_s, policy.initial_s * 2 ** (attempts.count - 1))))


def new_nonce() -> str:
    return uuid.uuid4().hex


def write_with_nonce(
    retrier: Retrier,
    what: str,
    upload: Callable[[str], int],
    read_back: Callable[[], tuple[int, str | None]],
    nonce: str | None = None,
) -> int:
    """A conditional write (create or generation-matched rewrite) that survives a lost response.

    `upload(nonce)` sends the write with `nonce` in its custom metadata and returns the new
    generation, raising PreconditionFailed on 412; `read_back()` returns the object's generation and
    nonce now (NotFound if it is gone). Returns the generation of our write, or raises
    PreconditionFailed when the object is somebody else's (see the module docstring).
    """
    nonce = nonce or new_nonce()
    attempts = Attempts()
    try:
        return retrier.call(what, lambda: upload(nonce), attempts)
    except PreconditionFailed:
        if not attempts.retried:
            raise
    try:
        generation, found = retrier.call(f"read back ({what})", read_back)
    except NotFound:
        raise PreconditionFailed(f"{what}: precondition failed, and the object is gone now") from None
    if found == nonce:
        log.info("event=ambiguous_write_resolved call=%r outcome=ours generation=%s", what, generation)
        return generation
    log.info("event=ambiguous_write_resolved call=%r outcome=theirs", what)
    raise PreconditionFailed(f"{what}: precondition failed (another writer's object is there)")


def delete_with_retries(retrier: Retrier, what: str, delete: Callable[[], None], if_generation: int | None) -> None:
    """A delete; a 404 after a retry at a generation means our lost first attempt deleted it (only the
    holder of a generation ever deletes at that generation)."""
    attempts = Attempts()
    try:
        retrier.call(what, delete, attempts)
    except NotFound:
        if attempts.retried and if_generation is not None:
            return
        raise
