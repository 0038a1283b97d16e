"""Progress of a long step (an upload, a model mirror, a submit of 100,000 tasks, machines booting).

On a terminal it is a bar (tqdm, on stderr); anywhere else (a log, CI, a pipe) it is one `key=value` line every
`every_s` seconds and one at the end, so a log shows a long step moving without a line per item:

    event=progress step=submit done=42000 total=100000 unit=tasks rate=3120/s elapsed_s=13.5

`Progress` is a context manager; `advance(n)` counts, `set(n)` sets (for a figure read back, such as the
machines up). It is thread-safe: the submit's and the upload's worker threads count into one bar.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

log = logging.getLogger("gcs_spawner")

#: Seconds between plain progress lines (the STYLE's "a log line every N seconds").
EVERY_S = 10.0


class Progress:
    def __init__(self, step: str, total: int | None, unit: str = "items", *, stream: TextIO | None = None,
                 every_s: float = EVERY_S, bar: bool | None = None, clock=time.monotonic):
        self.step, self.total, self.unit = step, total, unit
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self.done = 0
        self._clock = clock
        self._started = clock()
        self._last_line = self._started
        self._lock = threading.Lock()
        self._closed = False
        if bar is None:
            bar = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._bar = None
        if bar:
            try:
                from tqdm import tqdm
            except ImportError:  # the line form works everywhere
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=step, unit=f" {unit}", file=self.stream, dynamic_ncols=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close(failed=exc[0] is not None)

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            self._show(n)

    def set(self, value: int) -> None:
        with self._lock:
            delta, self.done = value - self.done, value
            self._show(delta)

    def _show(self, delta: int) -> None:
        if self._bar is not None:
            self._bar.update(delta)
            return
        now = self._clock()
        if now - self._last_line >= self.every_s:
            self._last_line = now
            self._line("progress")

    def _line(self, event: str) -> None:
        elapsed = max(1e-9, self._clock() - self._started)
        total = "" if self.total is None else f" total={self.total}"
        print(f"event={event} step={self.step} done={self.done}{total} unit={self.unit} "
              f"rate={self.done / elapsed:.3g}/s elapsed_s={elapsed:.1f}", file=self.stream, flush=True)

    def close(self, failed: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._bar is not None:
                self._bar.close()
                self._bar = None
                return
            if self.total is None or self.total > 0 or self.done:
                self._line("progress_stopped" if failed else "progress_done")
