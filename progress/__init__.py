"""Progress of a long step, the one reporter of every command and of consume.py (bottom floor: imports nothing of
ours, so extract/ and gcs_spawner/ both use it).

On a terminal it is a bar (tqdm, on stderr; log records print above it, not through it); anywhere else (a log, CI, a
pipe) it is one `key=value` line every `every_s` seconds, so a log shows a long step moving without a line per item.
A step of gcs-spawner (an upload, a model mirror, a submit of 100,000 tasks, machines booting) counts its items, and
ends with one more line:

    event=progress step=submit done=42000 total=100000 unit=tasks rate=3120/s elapsed_s=13.5
    event=progress_done step=submit done=100000 total=100000 unit=tasks rate=3150/s elapsed_s=31.7

consume.py's run loop counts samples and also `measures` the tokens in them, whose rate is the figure that matters
(`measure="tokens"`); its lines go to its logger, and the task's own end line closes it:

    event=progress samples=4000 total=10000 tokens=8192000 tokens_per_s=41250.3 elapsed_s=198.6

`Progress` is a context manager; `advance(n, measured)` counts, `set(n)` sets (for a figure read back, such as the
machines up). It is thread-safe: the submit's and the upload's worker threads count into one bar.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from typing import TextIO

#: Seconds between plain progress lines (the STYLE's "a log line every N seconds").
EVERY_S = 10.0


class Progress:
    """`step` names the step in its lines and on its bar; `total` is None when unknown; `measure` names a second
    quantity counted beside the items, reported with its rate instead of theirs. Lines go to `log` (INFO) when
    given, else to `stream`; `closing_line` ends them with `event=progress_done` (or `progress_stopped` on an
    error). `bar` forces the bar on or off; by default it is on when `stream` is a terminal."""

    def __init__(self, step: str | None, total: int | None, unit: str = "items", *, measure: str | None = None,
                 stream: TextIO | None = None, log: logging.Logger | None = None, every_s: float = EVERY_S,
                 bar: bool | None = None, closing_line: bool = True, clock=time.monotonic):
        self.step, self.total, self.unit, self.measure = step, total, unit, measure
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self.done = 0
        self.measured = 0
        self._log = log
        self._closing_line = closing_line
        self._clock = clock
        self._started = clock()
        self._last_line = self._started
        self._lock = threading.Lock()
        self._closed = False
        if bar is None:
            bar = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar = None
        self._redirect = contextlib.ExitStack()
        if bar:
            try:
                from tqdm import tqdm
                from tqdm.contrib.logging import logging_redirect_tqdm
            except ImportError:  # the line form works everywhere
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=step, unit=f" {unit}", file=self.stream, dynamic_ncols=True)
                self._redirect.enter_context(logging_redirect_tqdm())

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close(failed=exc[0] is not None)

    def advance(self, n: int = 1, measured: int = 0) -> None:
        with self._lock:
            self.done += n
            self.measured += measured
            self._show(n)

    def set(self, value: int) -> None:
        with self._lock:
            delta, self.done = value - self.done, value
            self._show(delta)

    def _show(self, delta: int) -> None:
        if self._bar is not None:
            self._bar.update(delta)
            if self.measure is not None:
                rate = self.measured / self._elapsed()
                self._bar.set_postfix({f"{self.measure}_per_s": f"{rate:,.0f}"}, refresh=False)
            return
        now = self._clock()
        if now - self._last_line >= self.every_s:
            self._last_line = now
            self._line("progress")

    def _elapsed(self) -> float:
        return max(1e-9, self._clock() - self._started)

    def _line(self, event: str) -> None:
        elapsed = self._elapsed()
        total = "" if self.total is None else f" total={self.total}"
        if self.measure is None:
            line = (f"event={event} step={self.step} done={self.done}{total} unit={self.unit} "
                    f"rate={self.done / elapsed:.3g}/s elapsed_s={elapsed:.1f}")
        else:
            line = (f"event={event} {self.unit}={self.done}{total} {self.measure}={self.measured} "
                    f"{self.measure}_per_s={self.measured / elapsed:.1f} elapsed_s={elapsed:.1f}")
        if self._log is not None:
            self._log.info(line)
        else:
            print(line, file=self.stream, flush=True)

    def close(self, failed: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._redirect.close()
            if self._bar is not None:
                self._bar.close()
                self._bar = None
                return
            if self._closing_line and (self.total is None or self.total > 0 or self.done):
                self._line("progress_stopped" if failed else "progress_done")
