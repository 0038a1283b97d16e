"""A store wrapper that counts requests, so a tool can state what it cost (e.g. `tools/status.py`)."""

from __future__ import annotations

import collections
import threading

from objectstore.base import MAX_LIST_PAGE, ObjectStore


class CountingStore(ObjectStore):
    """Delegates every call to `inner` and counts it under "<operation> <top-level prefix>/".

    Several stores may share one `counts` (with its `lock`), e.g. one per worker thread of a benchmark."""

    def __init__(
        self,
        inner: ObjectStore,
        counts: collections.Counter[str] | None = None,
        lock: threading.Lock | None = None,
    ):
        self.inner = inner
        self.root_url = inner.root_url
        self.same_object_write_gap_s = inner.same_object_write_gap_s
        self.counts: collections.Counter[str] = counts if counts is not None else collections.Counter()
        self._lock = lock or threading.Lock()

    @property
    def requests(self) -> int:
        return sum(self.counts.values())

    def _count(self, op: str, name: str) -> None:
        with self._lock:
            self.counts[f"{op} {name.split('/', 1)[0]}/"] += 1

    def read(self, name):
        self._count("read", name)
        return self.inner.read(name)

    def create(self, name, data, metadata=None):
        self._count("create", name)
        return self.inner.create(name, data, metadata)

    def write(self, name, data, if_generation, metadata=None):
        self._count("write", name)
        return self.inner.write(name, data, if_generation, metadata)

    def delete(self, name, if_generation=None):
        self._count("delete", name)
        return self.inner.delete(name, if_generation)

    def put(self, name, data, metadata=None, content_type=None):
        self._count("put", name)
        return self.inner.put(name, data, metadata, content_type=content_type)

    def put_file(self, name, path):
        self._count("put", name)
        return self.inner.put_file(name, path)

    def open_read(self, name):
        self._count("open", name)
        return self.inner.open_read(name)

    def list_page(self, prefix, page_token=None, start_offset=None, page_size=MAX_LIST_PAGE, end_offset=None):
        self._count("list", prefix)
        return self.inner.list_page(prefix, page_token, start_offset, page_size, end_offset)

    def child(self, prefix):
        return CountingStore(self.inner.child(prefix), self.counts, self._lock)
