"""A machine's own copy of a bucket checkpoint's weights: read from the bucket once per machine, not once per task.

The first task on a machine that loads a `gs://` model copies its safetensors files (those the index names, or
every `*.safetensors` without an index) into `$EXTRACT_WEIGHTS_CACHE` (default `$XDG_CACHE_HOME/gcs-spawner/
weights`; `off` reads in place every time, as `Checkpoint.from_store` does), by the same parallel ranged reads,
and every later task memory-maps the copy (`Checkpoint`), usually straight from the page cache.

**What is trusted.** A copy is used only if it is the object the bucket holds now and has not changed since it
was checked. Beside each file a record (`.<name>.verified.json`) holds the object's generation, size and
CRC32C, and the file's stamp (inode, size, ctime) and the boot it was checked in:

- a download is checked against the object's size and the CRC32C the store reports for it (GCS does:
  https://cloud.google.com/storage/docs/hashes-etags#crc32c; a local-directory bucket reports none, and the CRC32C
  computed here is kept);
- at reuse the object's generation and size (from the listing the load makes anyway) must match the record, and
  the file its stamp. Any write to the file changes its ctime, which no process can set back (stat(2)); a reboot
  may have lost pages that were never flushed (the copy is not fsync'ed: that would make the first task wait for
  the disk), so a record from an earlier boot (`/proc/sys/kernel/random/boot_id`) counts as a changed stamp;
- a changed stamp, or `$EXTRACT_WEIGHTS_VERIFY=always`, recomputes the file's CRC32C (about 0.6 s a GB from the
  page cache on a 2-core machine) and compares it with the record.

A copy that fails any check is deleted and copied again; files the checkpoint no longer names are deleted. Too
little free disk for the copy, or a local error writing it, falls back to reading in place: the cache never fails
a task that could run without it. Two consumers on one machine copy under an exclusive lock, one after the
other.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import pathlib
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import google_crc32c
import numpy as np

import objectstore
from activations.format import crc32c_b64
from extract import cachedir
from extract.errors import BadInput, TransientIOError
from extract.weights import INDEX_FILE, READ_PIECE_BYTES, Checkpoint, default_read_streams

log = logging.getLogger(__name__)

ENV = "EXTRACT_WEIGHTS_CACHE"
VERIFY_ENV = "EXTRACT_WEIGHTS_VERIFY"
#: Free disk left after a copy; below it the weights are read in place instead.
RESERVE_BYTES = 2 * 2**30
_BOOT_ID = pathlib.Path("/proc/sys/kernel/random/boot_id")


def default_root() -> pathlib.Path | None:
    return cachedir.setting(ENV, cachedir.cache_root() / "weights")


def boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return "unknown"


# -- CRC32C of pieces, combined ------------------------------------------------------------------------------------
# A copy is checked against the object's CRC32C without a second pass over the file: each piece's CRC32C is
# computed by the thread that downloaded it (google-crc32c releases the GIL), and the pieces' values are combined
# in order. crc(A + B) = shift(crc(A), len(B)) ^ crc(B), where shifting by n zero bytes is a linear map over GF(2)
# (the method of zlib's crc32_combine, here with CRC32C's reflected polynomial 0x82F63B78).


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def zeros_operator(length: int) -> list[int]:
    """The 32x32 GF(2) matrix that appends `length` zero bytes to a CRC32C."""
    operator = [1 << n for n in range(32)]  # identity
    power = [0x82F63B78] + [1 << n for n in range(31)]  # one zero bit
    for _ in range(3):  # one zero byte
        power = _gf2_square(power)
    while length:
        if length & 1:
            operator = [_gf2_times(power, column) for column in operator]
        length >>= 1
        if length:
            power = _gf2_square(power)
    return operator


def crc32c_of_pieces(crcs: list[int], lengths: list[int]) -> int:
    """The CRC32C of the concatenation of pieces with these CRC32Cs and lengths."""
    operators: dict[int, list[int]] = {}
    total = 0
    for crc, length in zip(crcs, lengths):
        if length not in operators:
            operators[length] = zeros_operator(length)
        total = _gf2_times(operators[length], total) ^ crc
    return total


def file_crc32c(path: pathlib.Path) -> str:
    """The file's CRC32C (GCS's encoding), over a read-only memory map: no copy of the file in memory."""
    if path.stat().st_size == 0:
        return crc32c_b64(b"")
    return crc32c_b64(np.memmap(path, dtype=np.uint8, mode="r"))


@dataclasses.dataclass(frozen=True)
class Record:
    """What was checked about one local copy, and when."""

    generation: int
    size: int
    crc32c: str
    stamp: tuple[int, int, int]  # inode, size, ctime_ns of the file when it was checked
    boot: str

    @staticmethod
    def stamp_of(path: pathlib.Path) -> tuple[int, int, int]:
        st = path.stat()
        return (st.st_ino, st.st_size, st.st_ctime_ns)


def _record_path(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(f".{path.name}.verified.json")


def _read_record(path: pathlib.Path) -> Record | None:
    try:
        raw = json.loads(_record_path(path).read_text())
        return Record(int(raw["generation"]), int(raw["size"]), str(raw["crc32c"]), tuple(raw["stamp"]), raw["boot"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_record(path: pathlib.Path, record: Record) -> None:
    target = _record_path(path)
    partial = target.with_name(target.name + f".part{os.getpid()}")
    partial.write_text(json.dumps(dataclasses.asdict(record)))
    os.replace(partial, target)


class WeightCache:
    """The copies of one bucket checkpoint on this machine (`directory`), kept in step with `store`."""

    def __init__(self, store: objectstore.ObjectStore, directory: pathlib.Path, streams: int | None = None,
                 verify_always: bool = False):  # fmt: skip
        self.store = store
        self.directory = directory
        self.streams = streams or default_read_streams()
        self.verify_always = verify_always
        self.checked = {"reused": 0, "copied": 0, "rebuilt": 0}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.directory / ".lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _weight_entries(self) -> tuple[list[objectstore.Entry], bytes | None]:
        """The listed objects of the files the checkpoint reads, and its index's bytes if it has one."""
        index = None
        try:
            listed = {e.name: e for e in self.store.list("") if "/" not in e.name}
            if INDEX_FILE in listed:
                index = self.store.read(INDEX_FILE).data
                names = sorted(set(json.loads(index)["weight_map"].values()))
            else:
                names = sorted(n for n in listed if n.endswith(".safetensors"))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            where = self.store.url(INDEX_FILE)
            raise BadInput(f"weights index {where} is unreadable or has no weight_map: {exc}") from exc
        except objectstore.StoreError as exc:
            raise TransientIOError(f"model={self.store.root_url!r}: listing its weights failed: {exc}") from exc
        missing = [n for n in names if n not in listed]
        if missing:
            raise BadInput(f"weights file {missing[0]} named by {INDEX_FILE} is missing from {self.store.root_url}")
        if not names:
            raise BadInput(f"model={self.store.root_url!r} has no *.safetensors weights (model.safetensors or shards)")
        return [listed[n] for n in names], index

    def sound(self, entry: objectstore.Entry) -> bool:
        """Whether the local copy of `entry` may be used as it is (the checks in the module's docstring)."""
        path = self.directory / entry.name
        record = _read_record(path)
        if record is None or not path.is_file():
            return False
        if (record.generation, record.size) != (entry.generation, entry.size) or path.stat().st_size != entry.size:
            return False
        if entry.crc32c is not None and record.crc32c != entry.crc32c:
            return False
        if not self.verify_always and record.stamp == Record.stamp_of(path) and record.boot == boot_id():
            return True
        crc = file_crc32c(path)
        if crc != record.crc32c:
            log.warning("event=weights_cache_damaged file=%s expected_crc32c=%s found=%s: copying it again",
                        path, record.crc32c, crc)  # fmt: skip
            return False
        _write_record(path, dataclasses.replace(record, stamp=Record.stamp_of(path), boot=boot_id()))
        return True

    def _copy(self, entry: objectstore.Entry) -> None:
        """Download one object by parallel ranged reads into a temporary file, check it, and move it into place."""
        path = self.directory / entry.name
        partial = path.with_name(f".{entry.name}.part{os.getpid()}")
        where = self.store.url(entry.name)

        def piece(lo: int) -> int:
            hi = min(entry.size, lo + READ_PIECE_BYTES)
            data = self.store.read_range(entry.name, lo, hi)
            if len(data) != hi - lo:
                raise TransientIOError(f"weights file {where}: short read at {lo} ({len(data)} of {hi - lo} bytes)")
            os.pwrite(fd, data, lo)
            return google_crc32c.value(data)

        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.ftruncate(fd, entry.size)
                starts = range(0, entry.size, READ_PIECE_BYTES)
                with ThreadPoolExecutor(max_workers=self.streams, thread_name_prefix="weights-copy") as pool:
                    crcs = [future.result() for future in [pool.submit(piece, lo) for lo in starts]]
            finally:
                os.close(fd)
            lengths = [min(READ_PIECE_BYTES, entry.size - lo) for lo in starts]
            crc = base64.b64encode(crc32c_of_pieces(crcs, lengths).to_bytes(4, "big")).decode()
            if entry.crc32c is not None and crc != entry.crc32c:
                raise TransientIOError(f"weights file {where}: the copy's CRC32C is {crc}, the object's {entry.crc32c}")
            _record_path(path).unlink(missing_ok=True)
            os.replace(partial, path)
            _write_record(path, Record(entry.generation, entry.size, crc, Record.stamp_of(path), boot_id()))
        except objectstore.StoreError as exc:
            raise TransientIOError(f"weights file {where} could not be read: {exc}") from exc
        finally:
            partial.unlink(missing_ok=True)

    def reuse(self) -> pathlib.Path | None:
        """The directory when it holds a sound copy of every weights file (and the same index) already, else None;
        copies nothing."""
        entries, index = self._weight_entries()
        if not self.directory.is_dir():
            return None
        with self._locked():
            index_path = self.directory / INDEX_FILE
            same_index = (not index_path.exists()) if index is None else (
                index_path.is_file() and index_path.read_bytes() == index)  # fmt: skip
            if not same_index or not all(self.sound(entry) for entry in entries):
                return None
            self.checked["reused"] += len(entries)
        return self.directory

    def sync(self) -> pathlib.Path | None:
        """Make the directory hold sound copies of every weights file (and the index); return it, or None when the
        disk cannot hold them (read in place instead)."""
        entries, index = self._weight_entries()
        self.directory.mkdir(parents=True, exist_ok=True)
        with self._locked():
            wanted = {e.name for e in entries}
            for stale in self.directory.glob("*.safetensors"):
                if stale.name not in wanted:
                    stale.unlink()
                    _record_path(stale).unlink(missing_ok=True)
            todo = []
            for entry in entries:
                if self.sound(entry):
                    self.checked["reused"] += 1
                else:
                    self.checked["rebuilt" if (self.directory / entry.name).exists() else "copied"] += 1
                    todo.append(entry)
            need = sum(e.size for e in todo)
            free = shutil.disk_usage(self.directory).free
            if todo and free < need + RESERVE_BYTES:
                log.warning("event=weights_cache_skipped dir=%s need_bytes=%d free_bytes=%d: reading in place",
                            self.directory, need, free)  # fmt: skip
                return None
            for entry in todo:
                (self.directory / entry.name).unlink(missing_ok=True)
                self._copy(entry)
            index_path = self.directory / INDEX_FILE
            if index is None:
                index_path.unlink(missing_ok=True)
            else:
                index_path.write_bytes(index)
        return self.directory


def _machine_copy(url: str, root: pathlib.Path) -> WeightCache:
    """The machine's copy of the checkpoint at `url`, under `root` (verified on every use when VERIFY_ENV says so)."""
    return WeightCache(
        objectstore.open_store(url), root / url.removeprefix("gs://").strip("/"),
        verify_always=os.environ.get(VERIFY_ENV, "").strip().lower() == "always",
    )  # fmt: skip


def reused_checkpoint(url: str, root: pathlib.Path | None = None) -> Checkpoint | None:
    """The checkpoint at `url` from this machine's copy when that copy is sound already (its headers read from the
    local files: no bucket read but the listing), else None: nothing is copied here."""
    root = root if root is not None else default_root()
    if root is None:
        return None
    started = time.monotonic()
    cache = _machine_copy(url, root)
    try:
        local = cache.reuse()
    except OSError as exc:  # the local disk, not the bucket: the caller reads the bucket's headers instead
        log.warning("event=weights_cache_failed url=%s error=%r: reading in place", url, exc)
        return None
    if local is None:
        return None
    log.info("event=weights_cache url=%s dir=%s reused=%d copied=0 rebuilt=0 seconds=%.1f", url, local,
             cache.checked["reused"], time.monotonic() - started)  # fmt: skip
    return Checkpoint(local)


def open_checkpoint(url: str, root: pathlib.Path | None = None) -> Checkpoint:
    """The checkpoint at `url` (gs://bucket/prefix, or a directory used as a bucket) from this machine's copy,
    made or repaired first if needed; read in place when the cache is off or the disk too small."""
    root = root if root is not None else default_root()
    if root is None:
        return Checkpoint.from_store(url)
    started = time.monotonic()
    cache = _machine_copy(url, root)
    try:
        local = cache.sync()
    except OSError as exc:  # the local disk, not the bucket: read in place
        log.warning("event=weights_cache_failed url=%s error=%r: reading in place", url, exc)
        local = None
    if local is None:
        return Checkpoint.from_store(url)
    log.info(
        "event=weights_cache url=%s dir=%s reused=%d copied=%d rebuilt=%d seconds=%.1f", url, local,
        cache.checked["reused"], cache.checked["copied"], cache.checked["rebuilt"], time.monotonic() - started,
    )  # fmt: skip
    return Checkpoint(local)
