"""Where a consumer process's seconds go: the phase ledger of one task attempt, and its goodput.

A machine-minute is bought for the forward pass; everything else a task pays for is fixed cost. The ledger
splits the attempt's wall time, from the process's own start (read from the kernel, so the interpreter's start
counts too) to its last stored shard, into phases. Every instant is in exactly one phase:

| phase        | what runs                                                                                   |
|--------------|---------------------------------------------------------------------------------------------|
| `imports`    | the interpreter, this project's modules, JAX and Flax                                       |
| `devices`    | the runtime: device initialisation, the compilation cache's setup (extract/compilecache.py) |
| `weights`    | the model: config, checkpoint files (extract/weightcache.py), weights placed on the devices  |
| `prepare`    | the tokenizer, the writer, and reading and tokenising until the first batch is ready        |
| `trace`      | tracing and lowering each program (one per batch shape), wherever it happens               |
| `compile`    | XLA's compile of each program, or its load from the compilation cache                       |
| `first_step` | the first step, from its dispatch until its outputs are ready (a resident consumer's later  |
|              | tasks have none: their engine has stepped before, and their first step is a steady one)   |
| `steady`     | the steady state: from the first step's end to the last step's end, less later programs     |
| `tail`       | from the last step's end until the last shard is stored                                     |

**Goodput** is `steady` over the sum of all phases; the **fixed seconds** are the sum of the others. The
steady state includes whatever the device waits for (the host, the writer's back-pressure): MFU measures that
part (docs/MODEL.md); goodput measures what a task pays to start and stop.

The phases travel in the progress records' `counters` (docs/PROTOCOL.md, "The consumer contract"), as
integer milliseconds under `goodput_ms_<phase>`, plus `goodput_attempts` (1 in an attempt's first record). Each
record carries what accrued since the previous one, so the queue's sum over the committed records (the done
marker's `counters`) is the task's total over all its attempts, up to each one's last stored shard; a killed
attempt counts up to its last committed shard. reporting/goodput.py reads them back from the done/ listing.

No JAX here: the reporting side imports the names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping

log = logging.getLogger(__name__)

PHASES = ("imports", "devices", "weights", "prepare", "trace", "compile", "first_step", "steady", "tail")
STEADY = "steady"
FIXED_PHASES = tuple(phase for phase in PHASES if phase != STEADY)
#: Counter names in the progress records and the done markers.
COUNTER_PREFIX = "goodput_ms_"
ATTEMPTS = "goodput_attempts"


def counter_name(phase: str) -> str:
    return COUNTER_PREFIX + phase


def is_goodput_counter(name: str) -> bool:
    return name == ATTEMPTS or name.startswith(COUNTER_PREFIX)


def process_age_s() -> float | None:
    """Seconds since this process was created, from the kernel (`/proc/self/stat` field 22, in clock ticks since
    boot, against CLOCK_BOOTTIME, the clock it counts in: proc(5)); None where there is no procfs."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read().decode()
        # The command name (field 2) is in parentheses and may hold spaces: count fields after its closing one.
        fields = stat[stat.rindex(")") + 2 :].split()
        started_ticks = int(fields[19])  # field 22 overall
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return age if 0 <= age < 86400 else None


class PhaseLedger:
    """Wall time split into PHASES. Thread-safe: the main thread moves between phases, the writer's thread drains
    the counters into each progress record as it stores it.

    `started_at` is when the attempt began on `clock`; the default is the process's creation (`process_age_s`),
    else now. `phase` is the one the time from then counts to: a resident consumer's later task starts at its
    claim in `prepare` (its imports, devices and weights are loaded already).
    """

    def __init__(
        self, started_at: float | None = None, clock: Callable[[], float] = time.monotonic, phase: str = "imports"
    ):
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
        self._clock = clock
        now = clock()
        if started_at is None:
            age = process_age_s()
            started_at = now - age if age is not None else now
        self._lock = threading.Lock()
        self._phase = phase
        self._since = started_at
        self._seconds = dict.fromkeys(PHASES, 0.0)
        self._drained_ms = dict.fromkeys(PHASES, 0)
        self._attempt_drained = False
        self.programs: list[dict] = []  # one entry per compiled program: what `compiled` was told

    @property
    def phase(self) -> str:
        return self._phase

    def enter(self, phase: str) -> None:
        """Close the open interval into the current phase; from now on time counts to `phase`."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
        with self._lock:
            now = self._clock()
            self._seconds[self._phase] += max(0.0, now - self._since)
            self._phase, self._since = phase, now

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """Count the block to `phase`, then return to the phase it interrupted."""
        previous = self._phase
        self.enter(phase)
        try:
            yield
        finally:
            self.enter(previous)

    def compiled(self, seq_len: int, packed: bool, seconds: float, cache: str) -> None:
        """Note one compiled program (the `compile` phase counts its time)."""
        with self._lock:
            self.programs.append({"seq_len": seq_len, "packed": packed, "seconds": round(seconds, 3), "cache": cache})

    def seconds(self) -> dict[str, float]:
        """Seconds per phase so far, the open interval included."""
        with self._lock:
            totals = dict(self._seconds)
            totals[self._phase] += max(0.0, self._clock() - self._since)
            return totals

    def drain(self) -> dict[str, int]:
        """The counters accrued since the last drain: whole milliseconds per phase (rounding carried over, so the
        drains add up to the total), and `goodput_attempts: 1` the first time."""
        totals = self.seconds()
        counters: dict[str, int] = {}
        with self._lock:
            for phase in PHASES:
                total_ms = int(totals[phase] * 1000)
                delta = total_ms - self._drained_ms[phase]
                if delta > 0:
                    counters[counter_name(phase)] = delta
                    self._drained_ms[phase] = total_ms
            if not self._attempt_drained:
                counters[ATTEMPTS] = 1
                self._attempt_drained = True
        return counters

    def summary(self) -> dict:
        """{phase: seconds}, the fixed seconds, the wall seconds and the goodput, for the log and benchmarks."""
        return summarize(self.seconds())

    def log_summary(self, task: str) -> dict:
        figures = self.summary()
        log.info(
            "event=goodput task=%s goodput=%.4f fixed_s=%.2f wall_s=%.2f %s programs=%d",
            task, figures["goodput"], figures["fixed_s"], figures["wall_s"],
            " ".join(f"{phase}_s={figures['phases'][phase]:.2f}" for phase in PHASES), len(self.programs),
        )  # fmt: skip
        return figures


def summarize(seconds: Mapping[str, float]) -> dict:
    """Fixed seconds, wall seconds and goodput (steady over wall; 0 for an empty attempt) from seconds per phase."""
    phases = {phase: float(seconds.get(phase, 0.0)) for phase in PHASES}
    wall = sum(phases.values())
    return {
        "phases": phases,
        "fixed_s": wall - phases[STEADY],
        "wall_s": wall,
        "goodput": phases[STEADY] / wall if wall > 0 else 0.0,
    }
