"""Noticing that this machine is about to be taken away.

Spot and preemptible VMs see `instance/preempted` turn TRUE about 30 s before they stop: the
worker has seconds to hand its task back, so the watcher calls `on_preempted()` once, from its own
thread.

`instance/maintenance-event` is different. A non-spot GPU or TPU VM that cannot live-migrate sees
TERMINATE_ON_HOST_MAINTENANCE up to an hour before the host maintenance stops it
(https://cloud.google.com/compute/docs/gpus/gpu-host-maintenance,
https://cloud.google.com/compute/docs/instances/host-maintenance-overview). Stopping then would
leave the machine idle, and billed, for that hour: the worker exits 0 and systemd does not restart
it. So a maintenance notice only calls `on_notice(value)` (the machine record shows it) and the
worker goes on; the actual stop is a guest shutdown, which reaches spawn.py as SIGTERM, and spawn.py
releases its lease then, as on any SIGTERM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import requests

from fleet.metadata import MetadataClient, MetadataError, MetadataNotFound

log = logging.getLogger(__name__)

PREEMPTED = "instance/preempted"
MAINTENANCE = "instance/maintenance-event"


def _is_termination(key: str, value: str) -> bool:
    value = value.strip().upper()
    if key == PREEMPTED:
        return value == "TRUE"
    # MIGRATE_ON_HOST_MAINTENANCE keeps the machine running; only TERMINATE takes it away.
    return value.startswith("TERMINATE")


class PreemptionWatcher:
    """Calls `on_preempted()` once when the metadata server announces preemption or termination.

    `start()` returns at once. `stop()` guarantees no callback after it returns; a long poll in
    flight is abandoned (the threads are daemons) rather than waited for.
    """

    def __init__(
        self,
        on_preempted: Callable[[], None],
        metadata: MetadataClient | None = None,
        poll_timeout_s: int = 60,
        min_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        keys: tuple[str, ...] = (PREEMPTED, MAINTENANCE),
        on_notice: Callable[[str], None] | None = None,
    ):
        self._on_preempted = on_preempted
        self._on_notice = on_notice
        self._metadata = metadata or MetadataClient()
        self._poll_timeout_s = poll_timeout_s
        self._min_backoff_s = min_backoff_s
        self._max_backoff_s = max_backoff_s
        self._keys = keys
        self._stopped = threading.Event()
        self._fire_lock = threading.Lock()
        self._fired = False
        self._threads: list[threading.Thread] = []

    @property
    def fired(self) -> bool:
        return self._fired

    def start(self) -> "PreemptionWatcher":
        for key in self._keys:
            thread = threading.Thread(target=self._watch, args=(key,), name=f"preemption-watch:{key}", daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("event=preemption_watch_started keys=%s host=%s", ",".join(self._keys), self._metadata.host)
        return self

    def stop(self, join_timeout_s: float = 0.2) -> None:
        with self._fire_lock:
            self._stopped.set()
        for thread in self._threads:
            thread.join(join_timeout_s)
        log.info("event=preemption_watch_stopped")

    def _fire(self, key: str, value: str) -> None:
        with self._fire_lock:
            if self._fired or self._stopped.is_set():
                return
            self._fired = True
        log.warning("event=preempted key=%s value=%s", key, value.strip())
        try:
            self._on_preempted()
        except Exception:
            # The callback is the worker's; a failure there would otherwise vanish with this thread.
            log.exception("event=preemption_callback_failed key=%s", key)

    def _watch(self, key: str) -> None:
        etag: str | None = None
        backoff_s = self._min_backoff_s
        while not self._stopped.is_set():
            try:
                if etag is None:
                    value, etag = self._metadata.current(key)
                else:
                    value, etag = self._metadata.wait_for_change(key, etag, self._poll_timeout_s)
            except MetadataNotFound:
                # A key the server does not serve (maintenance-event on some images) is not worth polling.
                log.info("event=preemption_watch_key_absent key=%s", key)
                return
            except (requests.RequestException, MetadataError) as err:
                log.warning("event=preemption_watch_retry key=%s backoff_s=%.1f error=%s", key, backoff_s, err)
                etag = None
                self._stopped.wait(backoff_s)
                backoff_s = min(backoff_s * 2, self._max_backoff_s)
                continue
            backoff_s = self._min_backoff_s
            if key == MAINTENANCE:
                self._notice(value)
            elif _is_termination(key, value):
                self._fire(key, value)
                return

    def _notice(self, value: str) -> None:
        value = value.strip()
        if value.upper() in ("", "NONE"):
            return
        log.warning("event=maintenance_notice value=%s action=keep_working_until_sigterm", value)
        if self._on_notice is not None:
            try:
                self._on_notice(value)
            except Exception:
                # The callback is the worker's; a failure there would otherwise vanish with this thread.
                log.exception("event=maintenance_callback_failed value=%s", value)
