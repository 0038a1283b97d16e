"""A local directory that behaves like a GCS bucket prefix, safe across processes on one machine.

Objects are plain files, so a user can open an output shard with any tool. The bookkeeping that
GCS keeps for us lives under `<root>/.objectstore/`:

- `lock`: an fcntl lock file. Mutations hold it exclusively, reads and listings hold it shared,
  so a reader never sees a file from one generation with the metadata of another.
- `generation`: the last generation handed out. Generations are `max(last + 1, now in µs)`, so they
  are monotonic across every object and every process, like GCS's.
- `meta/<name>.json`: generation, metageneration, custom metadata and update time of each object.

Opening a path inside an existing store (for example a task's output prefix) finds the enclosing
`.objectstore` and shares its lock and generations, so a child prefix is the same store.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import pathlib
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import BinaryIO

from objectstore.base import (
    DEFAULT_CONTENT_TYPE,
    MAX_LIST_PAGE,
    BadObjectName,
    Blob,
    Entry,
    NotFound,
    ObjectStore,
    Page,
    PreconditionFailed,
    check_name,
)

STATE_DIR = ".objectstore"
OBJECT_MODE = 0o644  # mkstemp's 0600 would hide a user's own output shards from their other tools


def _find_root(path: pathlib.Path) -> pathlib.Path:
    for candidate in (path, *path.parents):
        if (candidate / STATE_DIR).is_dir():
            return candidate
    return path


class LocalStore(ObjectStore):
    def __init__(self, path: str | os.PathLike[str]):
        requested = pathlib.Path(path).expanduser().resolve()
        self._root = _find_root(requested)
        self._prefix = "" if requested == self._root else requested.relative_to(self._root).as_posix() + "/"
        self._state = self._root / STATE_DIR
        (self._state / "meta").mkdir(parents=True, exist_ok=True)
        (self._state / "tmp").mkdir(exist_ok=True)
        self.root_url = str(requested)

    # -- plumbing ---------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        key = self._prefix + check_name(name)
        if key.split("/", 1)[0] == STATE_DIR:
            raise BadObjectName(f"object name {name!r} is reserved for the local store's bookkeeping")
        return key

    def _data_path(self, key: str) -> pathlib.Path:
        return self._root / key

    def _meta_path(self, key: str) -> pathlib.Path:
        return self._state / "meta" / (key + ".json")

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        with open(self._state / "lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _next_generation(self) -> int:
        counter = self._state / "generation"
        try:
            last = int(counter.read_text() or 0)
        except FileNotFoundError:
            last = 0
        generation = max(last + 1, time.time_ns() // 1000)
        self._atomic_write(counter, str(generation).encode())
        return generation

    def _atomic_write(self, path: pathlib.Path, data: bytes | memoryview) -> None:
        fd, tmp = tempfile.mkstemp(dir=self._state / "tmp")
        try:
            os.fchmod(fd, OBJECT_MODE)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def _meta(self, key: str) -> dict | None:
        try:
            return json.loads(self._meta_path(key).read_text())
        except FileNotFoundError:
            return None

    def _store(
        self, key: str, data: bytes | memoryview, metadata: Mapping[str, str] | None, content_type: str | None = None
    ) -> int:
        """Caller holds the exclusive lock."""
        generation = self._next_generation()
        data_path = self._data_path(key)
        if data_path.is_dir():
            raise BadObjectName(f"object name {key!r} is a directory of other objects in {self._root}")
        self._atomic_write(data_path, data)
        self._write_meta(key, generation, metadata, content_type)
        return generation

    def _write_meta(
        self, key: str, generation: int, metadata: Mapping[str, str] | None, content_type: str | None = None
    ) -> None:
        meta = {
            "generation": generation,
            "metageneration": 1,
            "metadata": dict(metadata or {}),
            "updated": dt.datetime.now(dt.timezone.utc).isoformat(),
        }
        if content_type:
            meta["content_type"] = content_type
        self._atomic_write(self._meta_path(key), json.dumps(meta).encode())

    def _remove(self, key: str) -> None:
        for path in (self._data_path(key), self._meta_path(key)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    # -- the contract -----------------------------------------------------------------------

    def read(self, name: str) -> Blob:
        key = self._key(name)
        with self._locked(exclusive=False):
            meta = self._meta(key)
            if meta is None:
                raise NotFound(f"{self.url(name)} does not exist")
            return Blob(name=name, generation=meta["generation"], data=self._data_path(key).read_bytes())

    def create(self, name: str, data: bytes, metadata: Mapping[str, str] | None = None) -> int:
        key = self._key(name)
        with self._locked(exclusive=True):
            if self._meta(key) is not None:
                raise PreconditionFailed(f"{self.url(name)} already exists")
            return self._store(key, data, metadata)

    def write(self, name: str, data: bytes, if_generation: int, metadata: Mapping[str, str] | None = None) -> int:
        key = self._key(name)
        with self._locked(exclusive=True):
            meta = self._meta(key)
            if meta is None or meta["generation"] != if_generation:
                found = "absent" if meta is None else f"at generation {meta['generation']}"
                raise PreconditionFailed(f"{self.url(name)} is {found}, not at generation {if_generation}")
            return self._store(key, data, metadata)

    def delete(self, name: str, if_generation: int | None = None) -> None:
        key = self._key(name)
        with self._locked(exclusive=True):
            meta = self._meta(key)
            if meta is None:
                raise NotFound(f"{self.url(name)} does not exist")
            if if_generation is not None and meta["generation"] != if_generation:
                raise PreconditionFailed(
                    f"{self.url(name)} is at generation {meta['generation']}, not at generation {if_generation}"
                )
            self._remove(key)

    def put(
        self, name: str, data: bytes | memoryview, metadata: Mapping[str, str] | None = None, content_type: str | None = None
    ) -> int:
        key = self._key(name)
        with self._locked(exclusive=True):
            return self._store(key, data, metadata, content_type)

    def put_file(self, name: str, path: str | os.PathLike[str]) -> int:
        key = self._key(name)
        fd, tmp = tempfile.mkstemp(dir=self._state / "tmp")
        os.close(fd)
        try:
            shutil.copyfile(path, tmp)  # the copy happens outside the lock; only the rename is under it
            os.chmod(tmp, OBJECT_MODE)
            with self._locked(exclusive=True):
                generation = self._next_generation()
                data_path = self._data_path(key)
                data_path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, data_path)
                self._write_meta(key, generation, None)
                return generation
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def open_read(self, name: str) -> BinaryIO:
        key = self._key(name)
        try:
            # The data file is only ever replaced atomically, so an open handle keeps one version.
            return open(self._data_path(key), "rb")
        except (FileNotFoundError, IsADirectoryError):
            raise NotFound(f"{self.url(name)} does not exist") from None

    def list_page(
        self,
        prefix: str,
        page_token: str | None = None,
        start_offset: str | None = None,
        page_size: int = MAX_LIST_PAGE,
        end_offset: str | None = None,
    ) -> Page:
        page_size = max(1, min(page_size, MAX_LIST_PAGE))
        full_prefix = self._prefix + prefix
        after = self._prefix + page_token if page_token else None
        start = self._prefix + start_offset if start_offset else None
        end = self._prefix + end_offset if end_offset else None
        with self._locked(exclusive=False):
            keys = sorted(self._keys_under(full_prefix))
            entries: list[Entry] = []
            more = False
            for key in keys:
                if (after is not None and key <= after) or (start is not None and key < start):
                    continue
                if end is not None and key >= end:
                    break
                meta = self._meta(key)
                if meta is None:  # a data file whose object was deleted under us: not an object
                    continue
                if len(entries) == page_size:
                    more = True
                    break
                entries.append(
                    Entry(
                        name=key[len(self._prefix) :],
                        generation=meta["generation"],
                        size=self._data_path(key).stat().st_size,
                        updated=dt.datetime.fromisoformat(meta["updated"]),
                        metadata=meta["metadata"],
                        content_type=meta.get("content_type", DEFAULT_CONTENT_TYPE),
                    )
                )
        return Page(entries, entries[-1].name if more else None)

    def _keys_under(self, full_prefix: str) -> Iterator[str]:
        directory = self._root / full_prefix.rpartition("/")[0]
        if not directory.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(directory):
            rel = pathlib.Path(dirpath).relative_to(self._root).as_posix()
            if rel == ".":
                dirnames[:] = [d for d in dirnames if d != STATE_DIR]
                rel = ""
            for filename in filenames:
                key = f"{rel}/{filename}" if rel else filename
                if key.startswith(full_prefix):
                    yield key

    def child(self, prefix: str) -> "LocalStore":
        return LocalStore(self._root / (self._prefix + check_name(prefix.rstrip("/"))))
