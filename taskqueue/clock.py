"""Wall and monotonic time, with a deliberate skew for tests.

Only the monotonic clock decides anything (lease expiry is observed on it); the wall clock only
stamps records for people. `SPAWN_CLOCK_SKEW_S` shifts the wall clock and `SPAWN_CLOCK_RATE`
scales the monotonic one, so tests can run workers whose clocks disagree.

The monotonic clock counts the time the machine spent suspended: it reads CLOCK_BOOTTIME where
there is one (Linux), which is CLOCK_MONOTONIC plus the time the system was suspended (man 2
clock_gettime). Compute Engine suspends a VM with an ACPI S3 signal to its guest
(https://cloud.google.com/compute/docs/instances/suspend-resume-instance), and CLOCK_MONOTONIC, what
`time.monotonic` reads, stands still meanwhile: a holder resumed after a TTL would believe its lease
still its own and start or keep running a task someone else has taken over (sim seed 2387). Elsewhere
the clock falls back to `time.monotonic`; the protocol stays safe with a clock that stops (every
write is conditional, docs/PROTOCOL.md), only such a holder's consumer may start and run until its
next heartbeat is refused.

Every wait in the queue goes through `Clock.wait`, so a simulator can substitute a virtual clock
(tests/simworld) and run the real claim loop a thousand times faster than wall time.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
import time


def _boot_time() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


#: Seconds since some fixed moment, suspensions included where the system can say so.
elapsed = _boot_time if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic


class Clock:
    def __init__(self, skew_s: float = 0.0, rate: float = 1.0):
        self.skew_s = skew_s
        self.rate = rate
        self._origin = elapsed()

    @classmethod
    def from_env(cls) -> "Clock":
        return cls(float(os.environ.get("SPAWN_CLOCK_SKEW_S", "0")), float(os.environ.get("SPAWN_CLOCK_RATE", "1")))

    def monotonic(self) -> float:
        return self._origin + (elapsed() - self._origin) * self.rate

    def wall(self) -> dt.datetime:
        return dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=self.skew_s)

    def wall_iso(self) -> str:
        return self.wall().isoformat(timespec="milliseconds")

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        """Sleep `seconds`, or less if `stop` is set meanwhile; True when stopped."""
        return stop.wait(max(0.0, seconds))
