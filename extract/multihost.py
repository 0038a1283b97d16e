"""One task across every host of a TPU slice: one JAX program, each host feeding and writing its own share.

What this module owns (docs/PROTOCOL.md "Slices", docs/CLOUD.md "Slices"):

- **The role** of this process in the slice, from the environment that `spawn.py` sets
  (`SPAWN_SLICE_HOSTS`, `SPAWN_HOST_INDEX`, `SPAWN_COORDINATOR`), and `jax.distributed.initialize`
  with explicit timeouts, so that a dead or partitioned host fails the program in bounded time
  instead of hanging every other host on a collective.
- **The shares.** The task's positions are cut into shard-sized blocks (a block is exactly one
  output shard, so shard names are the same as in a single-host run and cannot collide across
  hosts). Blocks some earlier attempt committed are skipped; the pending blocks are split into
  `process_count` contiguous groups, one per host (`host_share`). A host reads and tokenises only
  the rows of its own blocks.
- **The lockstep loop.** Every step, each host brings one batch of `batch_size / process_count`
  rows (or padding once its share is used up). The hosts agree on the step's sequence length and
  exchange their token rows (small: int32), so every host holds the global batch and the model can
  be sharded over the whole slice's mesh (tensor parallel across hosts) as well as over data. Each
  host keeps the activations of its own rows (they are always on its own devices: the mesh lists
  devices process by process) and writes its own shards under the shared fenced prefix.
- **Gathering progress.** Process 0 runs under the slice's leader, whose progress file is the one
  the lease commits. Each step, hosts send the progress records of shards they stored since the
  last step; process 0 appends them. Process 0 exits 0 only after every host has stored its share
  and its records are in that file, so the done marker can never precede a host's part.
- **Failure.** A host that raises tells the others through the next step's status, and every host
  exits with the same code (65 stays a bad-input dead letter). A host that dies resets its gloo/ICI
  connections (the others fail at once), or stops sending coordination heartbeats: after
  `heartbeat_timeout_s` the JAX coordination service terminates every other process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from extract import compilecache, data
from extract.batching import Batch, Prefetcher, batches_for_slice
from extract.errors import BadInput, exit_code_for
from extract.job import ResumeState, Task, _read_json
from extract.writer import ProgressLog, ShardWriter, numpy_dtype

log = logging.getLogger(__name__)

#: How long a host waits for the rest of the slice to join jax.distributed (the slowest host's start-up).
INIT_TIMEOUT_S = 300
#: A host that sends no coordination heartbeat for this long is declared dead, and the JAX coordination
#: service terminates every other process of the slice (docs/CLOUD.md "Slices": how long a dead host takes to notice).
HEARTBEAT_TIMEOUT_S = 30
#: Time a finishing process waits for the others at the shutdown barrier.
SHUTDOWN_TIMEOUT_S = 30

# Step status sent by each host: what it brings to the next step.
_DONE, _BATCH, _STOPPED = 0, 1, 2


class SliceFailed(RuntimeError):
    """Another host of the slice failed or stopped; `exit_code` is the code the slice exits with."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True)
class SliceRole:
    """This process's place in the slice; process 0 runs on the leader host (the lease holder)."""

    process_index: int
    process_count: int
    coordinator: str | None  # host:port of process 0's coordination service; None for a single process
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S

    @classmethod
    def single(cls) -> SliceRole:
        return cls(process_index=0, process_count=1, coordinator=None)


def role_from_env(env: Mapping[str, str] | None = None) -> SliceRole | None:
    """The role `spawn.py` passed (SPAWN_SLICE_HOSTS > 1), or None for an ordinary single-host run."""
    env = os.environ if env is None else env
    hosts = env.get("SPAWN_SLICE_HOSTS")
    if not hosts or int(hosts) <= 1:
        return None
    index, coordinator = env.get("SPAWN_HOST_INDEX"), env.get("SPAWN_COORDINATOR")
    if index is None or not coordinator:
        raise BadInput("SPAWN_SLICE_HOSTS is set without SPAWN_HOST_INDEX and SPAWN_COORDINATOR; spawn.py sets all three")
    role = SliceRole(
        process_index=int(index),
        process_count=int(hosts),
        coordinator=coordinator,
        heartbeat_timeout_s=int(env.get("SPAWN_SLICE_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT_S)),
    )
    if not 0 <= role.process_index < role.process_count:
        raise BadInput(f"SPAWN_HOST_INDEX={index} is outside 0..{role.process_count - 1}")
    return role


#: The role this process joined its slice's program with (a process joins one program, once).
_joined: SliceRole | None = None


def initialize(role: SliceRole) -> bool:
    """Join the slice's JAX program. Every host must call this; process 0 serves the coordinator. A resident consumer
    calls it for each task: the program it joined for its first task serves them all. True when this call joined."""
    global _joined
    if role.process_count == 1:
        return False
    if _joined is not None:
        if _joined != role:
            raise RuntimeError(f"this process joined its slice as {_joined}; it cannot join again as {role}")
        return False
    import jax

    if (os.environ.get("JAX_PLATFORMS") or "").strip() == "cpu":
        # Cross-process collectives on CPU (the tests' simulated slice) need an implementation; TPUs use ICI.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    started = time.monotonic()
    jax.distributed.initialize(
        coordinator_address=role.coordinator,
        num_processes=role.process_count,
        process_id=role.process_index,
        initialization_timeout=INIT_TIMEOUT_S,
        heartbeat_timeout_seconds=role.heartbeat_timeout_s,
        shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
    )
    log.info(
        "event=slice_joined process=%d processes=%d coordinator=%s devices=%d local_devices=%d "
        "heartbeat_timeout_s=%d seconds=%.1f",
        role.process_index, role.process_count, role.coordinator, jax.device_count(), jax.local_device_count(),
        role.heartbeat_timeout_s, time.monotonic() - started,
    )  # fmt: skip
    _joined = role
    return True


# -- shares -------------------------------------------------------------------------------------


def committed_spans(progress: Sequence[Mapping[str, Any]], task: Task) -> list[tuple[int, int]]:
    """Sorted [start, end) spans the records cover. Gaps are fine (hosts commit out of order); overlaps are not."""
    spans = []
    for i, record in enumerate(progress):
        start, end = record.get("sample_start"), record.get("sample_end")
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= task.num_samples):
            raise BadInput(
                f"resume.progress[{i}]: covers [{start}, {end}), outside the task's {task.num_samples} samples; "
                "pass this task's records"
            )
        spans.append((start, end))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise BadInput(f"resume.progress: two records overlap at position {start}; pass the records as committed")
    return spans


def pending_blocks(num_samples: int, shard_size: int, committed: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Shard-sized blocks [k*shard_size, ...) not fully covered by committed spans, in order."""
    covered = np.zeros(num_samples, dtype=bool)
    for start, end in committed:
        covered[start:end] = True
    blocks = []
    for start in range(0, num_samples, shard_size):
        end = min(start + shard_size, num_samples)
        if not covered[start:end].all():
            if covered[start:end].any():
                raise BadInput(
                    f"resume.progress: block [{start}, {end}) is partly committed; records must be whole shards of "
                    f"shard_size={shard_size} (the job changed between attempts?)"
                )
            blocks.append((start, end))
    return blocks


def host_share(blocks: Sequence[tuple[int, int]], process_index: int, process_count: int) -> list[tuple[int, int]]:
    """This host's contiguous group of the pending blocks, merged into runs: disjoint across hosts, covering all."""
    per, extra = divmod(len(blocks), process_count)
    first = process_index * per + min(process_index, extra)
    mine = blocks[first : first + per + (1 if process_index < extra else 0)]
    runs: list[tuple[int, int]] = []
    for start, end in mine:
        if runs and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return runs


def load_progress(path: str | os.PathLike[str] | None, task: Task) -> tuple[int, list[dict]]:
    """(attempt, committed records) from SPAWN_RESUME_FILE, records not required to tile a prefix."""
    if path is None:
        return 1, []
    raw = _read_json(path, "resume file")
    if not isinstance(raw, dict) or raw.get("task") not in (None, task.id):
        raise BadInput(f"resume file {path}: not a resume object for task {task.id!r}; pass this task's file")
    progress = raw.get("progress", [])
    if not isinstance(progress, list) or not all(isinstance(r, dict) for r in progress):
        raise BadInput(f"resume.progress in {path}: must be a list of record objects")
    attempt = raw.get("attempt", 1)
    return attempt if isinstance(attempt, int) and attempt >= 1 else 1, progress


def has_gaps(path: str | os.PathLike[str] | None, task: Task) -> bool:
    """True when committed records leave gaps (a slice committed them): only the share runner resumes those."""
    _, progress = load_progress(path, task)
    spans = committed_spans(progress, task)
    return any(a[1] != b[0] for a, b in zip(spans, spans[1:])) or bool(spans and spans[0][0] != 0)


# -- the lockstep loop --------------------------------------------------------------------------


class _Outbox:
    """The progress sink of this host's writers.

    Process 0 writes records straight to the leader's progress file; other hosts queue them for the next
    exchange. A record marked `final` by a writer whose range ends before the task does is not the task's
    final record: the flag is dropped (its stats stay, as `host_stats`).
    """

    def __init__(self, progress: ProgressLog, task_end: int, is_writer: bool):
        self._progress = progress
        self._task_end = task_end
        self._is_writer = is_writer
        self._lock = threading.Lock()
        self._queued: list[dict] = []

    def append(self, record: Mapping[str, Any]) -> None:
        record = dict(record)
        if record.get("final") and record["sample_end"] != self._task_end:
            del record["final"]
            record["host_stats"] = record.pop("stats", None)
        with self._lock:
            if self._is_writer:
                self._progress.append(record)
            else:
                self._queued.append(record)

    def take(self) -> list[dict]:
        with self._lock:
            taken, self._queued = self._queued, []
        return taken

    def append_from_peers(self, records: Sequence[Mapping[str, Any]]) -> None:
        with self._lock:
            for record in records:
                self._progress.append(record)

    def close(self) -> None:
        pass  # the caller closes the progress log


class _OwnRows:
    """This host's rows [lo, hi) of a global [batch, ...] output, as a numpy array when the writer asks for one.

    The rows are on this host's devices (`make_mesh` orders devices by process), so nothing crosses hosts here.
    """

    def __init__(self, array: Any, lo: int, hi: int):
        self._array, self._lo, self._hi = array, lo, hi

    def __array__(self, dtype=None, copy=None):
        pieces: dict[int, np.ndarray] = {}  # first row -> rows; replicas along "model" hold the same rows
        for shard in self._array.addressable_shards:
            rows = shard.index[0]
            start = rows.start or 0
            stop = rows.stop if rows.stop is not None else self._array.shape[0]
            lo, hi = max(start, self._lo), min(stop, self._hi)
            if lo < hi and lo not in pieces:
                pieces[lo] = np.asarray(shard.data)[lo - start : hi - start]
        out = np.concatenate([pieces[k] for k in sorted(pieces)]) if pieces else None
        if out is None or out.shape[0] != self._hi - self._lo:
            raise RuntimeError(f"rows [{self._lo}, {self._hi}) of the output are not all on this host's devices")
        return out if dtype is None else out.astype(dtype)


def _exchange(values: np.ndarray) -> np.ndarray:
    """Every host's `values` stacked along a new first axis, in process order."""
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(values))


def _exchange_records(outbox: _Outbox, is_writer: bool, lengths: np.ndarray, payload: bytes) -> None:
    """Send queued records to process 0 (one allgather of padded JSON bytes; skipped when nobody has any)."""
    longest = int(lengths.max())
    if longest == 0:
        return
    buffer = np.zeros(longest, dtype=np.uint8)
    buffer[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    gathered = _exchange(buffer)
    if is_writer:
        for host, length in enumerate(lengths):
            if host != 0 and length:
                outbox.append_from_peers(json.loads(gathered[host, :length].tobytes()))


@dataclasses.dataclass(frozen=True)
class SliceInputs:
    """Like consumer.RunInputs, but resume comes as the raw committed records: a slice's may have gaps."""

    job: Any
    task: Task
    output_url: str
    resume_path: str | None = None
    progress_path: str | None = None
    attempt: int | None = None  # SPAWN_ATTEMPT, which wins over the resume file's
    log_every_s: float = 30.0

    @property
    def resume(self) -> ResumeState:
        attempt = self.attempt or load_progress(self.resume_path, self.task)[0]
        return ResumeState(attempt=attempt, records=(), committed=0)


def run_share(
    inputs: SliceInputs, role: SliceRole, stop: Any, engine: Any | None = None, tokenizer: Any | None = None
) -> Any:
    """Run this host's share of the task in lockstep with the other hosts. Returns a consumer.RunResult. A resident
    consumer passes the engine and tokenizer it keeps loaded (None: loaded here).

    Raises BadInput, I/O errors, Stopped (locally), SliceFailed (another host failed or stopped).
    """
    from extract.consumer import ProgressDisplay, RunResult, load_engine, load_tokenizer, shard_metadata

    job, task = inputs.job, inputs.task
    _, progress_records = load_progress(inputs.resume_path, task)
    blocks = pending_blocks(task.num_samples, job.shard_size, committed_spans(progress_records, task))
    share = host_share(blocks, role.process_index, role.process_count)
    if job.batch_size % role.process_count:
        raise BadInput(
            f"batch_size={job.batch_size} is not a multiple of the slice's {role.process_count} hosts: "
            "batch_size is the global batch, split evenly over hosts"
        )
    local_batch = job.batch_size // role.process_count
    log.info(
        "event=share task=%s process=%d processes=%d pending_blocks=%d ranges=%s samples=%d",
        task.id, role.process_index, role.process_count, len(blocks),
        ",".join(f"{a}-{b}" for a, b in share), sum(b - a for a, b in share),
    )  # fmt: skip
    if not blocks:
        return RunResult(records=[], stats=None, engine=engine)

    data.check_task_files(task, job.text_field)
    engine = engine if engine is not None else load_engine(job)
    if (cache := compilecache.active()) is not None:  # seal what this host's compiles write (extract/compilecache.py)
        engine.compile_hook = lambda seq_len, packed, stage: cache.compiling() if stage == "compile" else contextlib.nullcontext()
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(engine, job)
    is_writer = role.process_index == 0
    progress = ProgressLog(inputs.progress_path if is_writer else None)
    outbox = _Outbox(progress, task.num_samples, is_writer)
    display = ProgressDisplay(total=sum(b - a for a, b in share), every_s=inputs.log_every_s)
    metadata = shard_metadata(inputs, engine)
    lo, hi = role.process_index * local_batch, (role.process_index + 1) * local_batch

    def my_batches() -> Iterator[tuple[int, Batch]]:
        for index, (start, end) in enumerate(share):
            documents = data.read_slice(task, job.text_field, skip=start)
            for batch in batches_for_slice(
                (doc for doc, _ in zip(documents, range(end - start))),
                tokenizer, start=start, end=end, batch_size=local_batch,
                shard_size=job.shard_size, buckets=job.buckets,
            ):  # fmt: skip
                yield index, batch

    def new_writer(index: int) -> ShardWriter:
        start, end = share[index]
        return ShardWriter(
            store=store, layers=engine.outputs, out_dtype=numpy_dtype(job.out_dtype_name), start=start, end=end,
            shard_size=job.shard_size, metadata=metadata, progress=outbox, flops_per_token=engine.flops_per_token,
            peak_flops=engine.peak_flops(), on_samples=display.update, on_bad_row=job.on_bad_row,
            widths={output: engine.width(output) for output in engine.outputs},
        )  # fmt: skip

    import objectstore

    store = objectstore.open_store(inputs.output_url)
    batches = Prefetcher(my_batches(), depth=4, name="tokenize", cancel=stop.event)
    source = iter(batches)
    writers = _Writers(new_writer)
    records: list[dict] = []
    failure: BaseException | None = None
    step = 0
    try:
        with stop.deferred():
            while True:
                status, item = _DONE, None
                try:
                    if stop.is_set():
                        status = _STOPPED
                    else:
                        item = writers.next_device_batch(source)
                        status = _BATCH if item is not None else _DONE
                        if item is None:
                            records += writers.finish_through(len(share))
                except Exception as exc:  # told to every host below, then re-raised here
                    failure, status = exc, -exit_code_for(exc)
                payload = json.dumps(outbox.take()).encode() if not is_writer else b"[]"
                seq_len = item[1].bucket if item is not None else 0
                header = _exchange(np.array([status, seq_len, len(payload)], dtype=np.int64))
                _exchange_records(outbox, is_writer, header[:, 2], payload)
                if failure is not None:
                    raise failure
                if (header[:, 0] < 0).any():
                    code = int(-header[:, 0].min())
                    raise SliceFailed(f"another host of the slice failed (exit {code})", code)
                if (header[:, 0] == _STOPPED).any():
                    stop.event.set()
                    records += writers.abort()
                    _final_exchange(outbox, is_writer)
                    log.warning("event=stopped task=%s process=%d step=%d", task.id, role.process_index, step)
                    return RunResult(records=records, stats=None, engine=engine, stopped=True)
                if (header[:, 0] == _DONE).all():
                    break
                width = int(header[:, 1].max())
                rows = np.full((local_batch, width), tokenizer.pad_id, dtype=np.int32)
                if item is not None:
                    tokens = item[1].token_ids
                    rows[:, : tokens.shape[1]] = tokens
                global_tokens = _exchange(rows).reshape(job.batch_size, width)
                hidden = engine.forward(global_tokens)
                if item is not None:
                    index, batch = item
                    own = type(hidden)({layer: _OwnRows(hidden[layer], lo, hi) for layer in engine.outputs})
                    if getattr(hidden, "nonfinite", None) is not None:
                        own.nonfinite = _OwnRows(hidden.nonfinite, lo, hi)
                    writers.open[index].submit(batch, own)
                step += 1
    except BaseException:
        try:
            writers.abort()
        except Exception as secondary:  # already failing: report the first error
            log.warning("event=writer_abort_failed error=%r", secondary)
        raise
    finally:
        batches.close()
        display.close()
        progress.close()
    log.info(
        "event=share_done task=%s process=%d steps=%d shards=%d compiled_programs=%s",
        task.id, role.process_index, step, len(records), getattr(engine, "compiled_programs", None),
    )  # fmt: skip
    return RunResult(records=records, stats=None, engine=engine)


class _Writers:
    """One ShardWriter per contiguous range of this host's share, opened in order, each finished once."""

    def __init__(self, new_writer):
        self._new_writer = new_writer
        self.open: dict[int, ShardWriter] = {}

    def next_device_batch(self, source) -> tuple[int, Batch] | None:
        """The next batch that needs the device; windows of empty texts go straight to their writer."""
        for index, batch in source:
            if index not in self.open:
                self.finish_through(index)  # earlier ranges are complete: store their last shards now
                self.open[index] = self._new_writer(index)
            if batch.token_ids is None:
                self.open[index].submit(batch, {})
                continue
            return index, batch
        return None

    def finish_through(self, index: int) -> list[dict]:
        records = []
        for earlier in sorted(i for i in self.open if i < index):
            records += self.open.pop(earlier).finish()
        return records

    def abort(self) -> list[dict]:
        records = []
        for index in sorted(self.open):
            records += self.open.pop(index).abort()
        return records


def _final_exchange(outbox: _Outbox, is_writer: bool) -> None:
    payload = json.dumps(outbox.take()).encode() if not is_writer else b"[]"
    lengths = _exchange(np.array([len(payload)], dtype=np.int64))[:, 0]
    _exchange_records(outbox, is_writer, lengths, payload)
