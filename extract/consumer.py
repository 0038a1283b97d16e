"""The run loop of one extraction task: slice -> tokens -> fixed-shape batches -> engine -> shards -> progress records.

Three stages overlap: a prefetch thread reads and tokenises the next batches, the main thread
dispatches them to the device (asynchronously), and the shard writer's threads copy results to
the host, encode and store them. Each queue between them is bounded, so a slow stage slows the
others instead of filling memory.

A resumed task starts at the first position no committed record covers; positions before it are
never read. Stopping (SIGTERM) drops the open shard and keeps only shards that are complete.

Bad rows follow the job's `on_bad_row`: skipped rows are recorded with the shard that covers
them (so a resumed run, which restarts at a shard boundary, records each one once), or the first
one fails the task with BadInput (exit 65).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from extract import compilecache, data
from extract.batching import Prefetcher, Tokenizer, batches_for_slice, shard_token_limit, window_start
from extract.errors import BadInput
from extract.job import Job, ResumeState, Task
from extract.memory import IN_FLIGHT_STEPS
from extract.phases import PhaseLedger
from extract.writer import FORMAT, ProgressLog, ShardWriter, numpy_dtype, sites_of
from progress import Progress

log = logging.getLogger(__name__)

#: Batches tokenised ahead of the device.
PREFETCH_BATCHES = 4
#: Batches dispatched to the device but not yet copied back; bounds device memory held by results (the memory
#: model counts them: extract.memory.HELD_STEPS).
INFLIGHT_BATCHES = IN_FLIGHT_STEPS


class Stopped(BaseException):
    """A stop signal arrived. A BaseException so that no `except Exception` on the way mistakes it for a failure."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


class StopRequest:
    """Set from a signal handler. Outside the run loop it raises `Stopped` at once; inside it the
    loop checks it between batches, so that complete shards are still stored."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self._deferred = False

    def request(self, signum: int) -> None:
        self.signum = signum
        self.event.set()
        if not self._deferred:
            raise Stopped(signum)

    def is_set(self) -> bool:
        return self.event.is_set()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        if self.event.is_set():
            raise Stopped(self.signum or 0)
        self._deferred = True
        try:
            yield
        finally:
            self._deferred = False


@dataclasses.dataclass
class Warm:
    """What a resident consumer keeps between tasks (extract/resident.py): the engine (its devices, weights and
    traced and compiled programs), the compilation cache and the tokenizer, for the job they were loaded for. A task
    of another job loads its own and replaces them."""

    job_key: str | None = None
    engine: Any | None = None
    cache: compilecache.CompileCache | None = None
    tokenizer: Tokenizer | None = None
    steps: int = 0  # steps the engine has run (a warm engine's first step of a task is a steady one)

    @staticmethod
    def key(job: Job) -> str:
        return json.dumps(job.to_dict(), sort_keys=True)

    def fits(self, job: Job) -> bool:
        return self.engine is not None and self.job_key == self.key(job)

    def keep(self, job: Job, engine: Any, cache: compilecache.CompileCache | None, tokenizer: Tokenizer) -> None:
        if engine is not self.engine:
            self.steps = 0
        self.job_key, self.engine, self.cache, self.tokenizer = self.key(job), engine, cache, tokenizer


@dataclasses.dataclass(frozen=True)
class RunInputs:
    job: Job
    task: Task
    output_url: str
    resume: ResumeState = dataclasses.field(default_factory=ResumeState.fresh)
    progress_path: str | None = None
    log_every_s: float = 30.0
    #: consume.py's ledger, started with the process: its phases then go into the progress records' counters
    #: (extract/phases.py). Without one the run keeps its own, from its start, and only logs it.
    phases: PhaseLedger | None = None
    #: Turn on this machine's compilation cache before the engine loads (consume.py does; in-process callers that
    #: pass their own engine need not).
    compile_cache: bool = False
    #: A resident consumer's loaded state: used when it fits the job, filled in when it does not.
    warm: Warm | None = None


@dataclasses.dataclass
class RunResult:
    records: list[dict[str, Any]]  # written by this attempt
    stats: dict[str, Any] | None
    engine: Any | None
    stopped: bool = False
    phases: dict[str, Any] | None = None  # PhaseLedger.summary() of the attempt


class PhasedProgressLog(ProgressLog):
    """The progress file, each record carrying the phase counters accrued since the previous one."""

    def __init__(self, path: str | None, ledger: PhaseLedger):
        super().__init__(path)
        self._ledger = ledger

    def append(self, record: dict[str, Any]) -> None:
        record.setdefault("counters", {}).update(self._ledger.drain())
        super().append(record)


@contextlib.contextmanager
def counted_compile(
    ledger: PhaseLedger, cache: compilecache.CompileCache | None, seq_len: int, packed: bool, stage: str
) -> Iterator[None]:
    """`Engine.compile_hook` of a run: each stage's time goes to its phase (`trace`, `compile`); the compile runs
    under the compilation cache's lock, and the log says whether the persistent cache had the program."""
    if stage != "compile":
        with ledger.during(stage):
            yield
        return
    before, started = compilecache.counts(), time.monotonic()
    with ledger.during("compile"), cache.compiling() if cache is not None else contextlib.nullcontext():
        yield
    after, seconds = compilecache.counts(), time.monotonic() - started
    if cache is None:
        how = "off"
    else:
        how = "hit" if after["hits"] > before["hits"] else "miss" if after["misses"] > before["misses"] else "uncached"
    ledger.compiled(seq_len, packed, seconds, how)
    log.info("event=program seq_len=%d packed=%s compile_s=%.2f persistent_cache=%s", seq_len, packed, seconds, how)


def ready_engine(job: Job, ledger: PhaseLedger, compile_cache: bool) -> tuple[Any, compilecache.CompileCache | None]:
    """The engine, its imports, devices and weights each counted to their phase; the compilation cache on first if
    asked (it belongs to the runtime's set-up: the `devices` phase)."""
    ledger.enter("imports")
    import jax
    import transformers  # noqa: F401  (the tokenizer's library: its import is most of the tokenizer's cost)

    from extract import engine as _engine  # noqa: F401  (JAX, Flax and the model code)

    ledger.enter("devices")
    jax.devices()
    cache = compilecache.enable() if compile_cache else None
    ledger.enter("weights")
    return load_engine(job), cache


class ProgressDisplay(Progress):
    """The run loop's progress: the one reporter (progress/) counting samples of `total` and the tokens in them, whose
    rate it reports; its lines go to this module's log, and the task's own end line closes it."""

    def __init__(self, total: int, every_s: float, tty: bool | None = None):
        super().__init__(None, total, "samples", measure="tokens", log=log, every_s=every_s, bar=tty,
                         closing_line=False)

    def update(self, samples: int, tokens: int) -> None:
        """The engine loop's `on_samples` callback."""
        self.advance(samples, tokens)


def load_engine(job: Job) -> Any:
    from extract.engine import Engine

    return Engine(
        job.model,
        job.layers,
        batch_size=job.batch_size,
        max_seq_len=job.max_seq_len,
        compute_dtype=job.compute_dtype_name,
        out_dtype=job.engine_out_dtype_name,
        mesh=job.mesh,
        sites=job.sites,
    )


def load_tokenizer(engine: Any, job: Job) -> Tokenizer:
    try:
        tokenizer = Tokenizer(engine.model_dir, job.max_seq_len)
    except Exception as exc:
        # The files are local by now, so a failure is the checkpoint's (a malformed tokenizer.json raises
        # ValueError, KeyError or the tokenizers library's bare Exception), the same on every retry.
        raise BadInput(
            f"model: cannot load a tokenizer from {engine.model_dir} ({exc}); the checkpoint needs tokenizer files"
        ) from exc
    vocab = len(tokenizer.hf)
    if vocab > engine.config.vocab_size:
        # An id past the embedding table would be clamped silently by XLA, not rejected.
        raise BadInput(
            f"model: the tokenizer has {vocab} tokens but config.json says vocab_size={engine.config.vocab_size}; "
            "the tokenizer does not belong to this checkpoint"
        )
    log.info("event=tokenizer single_id_strings=%s", ",".join(tokenizer.single_id_strings) or "none")
    return tokenizer


def shard_metadata(inputs: RunInputs, engine: Any) -> dict[str, str]:
    """`__metadata__` of every shard: safetensors wants strings, so structured values are JSON."""
    job, task = inputs.job, inputs.task
    return {
        "format": FORMAT,
        "task": task.id,
        "attempt": str(inputs.resume.attempt),
        "model": job.model,
        "model_type": engine.config.model_type,
        "num_hidden_layers": str(engine.config.num_hidden_layers),
        "hidden_size": str(engine.config.hidden_size),
        "layers": json.dumps(list(engine.layers)),
        **({"sites": json.dumps(sites_of(engine.outputs))} if sites_of(engine.outputs) else {}),
        "dtype": job.dtype,
        "compute_dtype": job.compute_dtype,
        "max_seq_len": str(job.max_seq_len),
        "tokenization": json.dumps(
            {"add_special_tokens": False, "split_special_tokens": True, "max_length": job.max_seq_len}
        ),
        "job": json.dumps(job.to_dict(), sort_keys=True),
        "task_manifest": json.dumps(task.to_dict(), sort_keys=True),
    }


def run(inputs: RunInputs, stop: StopRequest | None = None, engine: Any | None = None) -> RunResult:
    """Extract positions [committed, num_samples) of the task's slice. Raises BadInput, I/O errors, Stopped."""
    import objectstore

    stop = stop or StopRequest()
    job, task = inputs.job, inputs.task
    start, end = inputs.resume.committed, task.num_samples
    log.info("event=task_start task=%s samples=%d resume_at=%d output=%s", task.id, end, start, inputs.output_url)
    if start >= end:
        log.info("event=task_already_complete task=%s samples=%d", task.id, end)
        return RunResult(records=[], stats=None, engine=engine)

    ledger = inputs.phases or PhaseLedger(started_at=time.monotonic())
    ledger.enter("prepare")
    data.check_task_files(task, job.text_field)
    loaded_at = time.monotonic()
    cache, tokenizer, warm = None, None, inputs.warm
    if engine is None and warm is not None and warm.fits(job):
        engine, cache, tokenizer = warm.engine, warm.cache, warm.tokenizer
    elif warm is not None and warm.engine is not None:
        log.info("event=engine_replaced task=%s why=another job", task.id)
        warm.engine = warm.tokenizer = None  # drop the old engine's device arrays before loading another
    if engine is None:
        engine, cache = ready_engine(job, ledger, inputs.compile_cache)
    ledger.enter("prepare")
    engine.compile_hook = lambda seq_len, packed, stage: counted_compile(ledger, cache, seq_len, packed, stage)
    tokenizer = tokenizer or load_tokenizer(engine, job)
    if warm is not None:
        warm.keep(job, engine, cache, tokenizer)
    log.info(
        "event=model_ready model=%s model_type=%s outputs=%s batch_size=%d buckets=%s seconds=%.1f",
        job.model, engine.config.model_type, engine.outputs_summary(), engine.batch_size,
        ",".join(map(str, job.buckets)), time.monotonic() - loaded_at,
    )  # fmt: skip

    store = objectstore.open_store(inputs.output_url)
    out_dtype = numpy_dtype(job.out_dtype_name)
    # A token costs each output's values plus its token id (the writer's layout).
    widths = {output: engine.width(output) for output in engine.outputs}
    bytes_per_token = sum(widths.values()) * out_dtype.itemsize + 4
    bytes_per_token += 4 * len(widths) if job.dtype == "fp8" else 0  # a float32 scale per token and output
    bytes_per_token += 4 if job.sampling.active else 0  # and its position in its document (a sampled job's shards)
    shard_tokens = shard_token_limit(job.shard_bytes, bytes_per_token)
    progress = PhasedProgressLog(inputs.progress_path, ledger) if inputs.phases else ProgressLog(inputs.progress_path)
    display = ProgressDisplay(total=end - start, every_s=inputs.log_every_s)
    batches: Prefetcher | None = None
    try:
        with stop.deferred():
            writer = ShardWriter(
                store=store,
                layers=engine.outputs,
                widths=widths,
                on_bad_row=job.on_bad_row,
                out_dtype=out_dtype,
                start=start,
                end=end,
                shard_size=job.shard_size,
                metadata=shard_metadata(inputs, engine),
                progress=progress,
                flops_per_token=engine.flops_per_token,
                peak_flops=engine.peak_flops(),
                on_samples=display.update,
                depth=INFLIGHT_BATCHES,
                listed_skipped=inputs.resume.listed_skipped,
                shard_tokens=shard_tokens,
                sampling=job.sampling,
            )
            batches = Prefetcher(
                batches_for_slice(
                    # From the start of the window holding `start` (itself, unless resumed at a cut by bytes).
                    data.read_slice(
                        task, job.text_field, skip=window_start(start, engine.batch_size, job.shard_size, job.packing)
                    ),
                    tokenizer,
                    start=start,
                    end=end,
                    batch_size=engine.batch_size,
                    shard_size=job.shard_size,
                    buckets=job.buckets,
                    on_bad_row=job.on_bad_row,
                    packing=job.packing,
                ),
                depth=PREFETCH_BATCHES,
                name="tokenize",
                cancel=stop.event,
            )
            try:
                last = None  # the latest step's outputs: its end is the steady state's
                for batch in batches:
                    if stop.is_set():
                        break
                    if batch.token_ids is None:
                        hidden = {}
                    else:
                        if last is None:
                            # Its program's stages count to theirs (counted_compile). A resident consumer's engine
                            # that has stepped before is warm: the first step of its later tasks is a steady one.
                            ledger.enter("steady" if warm is not None and warm.steps else "first_step")
                        if batch.segment_ids is not None:  # packed rows (job.packing)
                            hidden = engine.forward(batch.token_ids, batch.segment_ids, batch.positions)
                        else:
                            hidden = engine.forward(batch.token_ids)
                        if ledger.phase == "first_step":
                            _wait(hidden)
                            ledger.enter("steady")
                        if warm is not None:
                            warm.steps += 1
                        last = hidden
                    writer.submit(batch, hidden)
                if stop.is_set():
                    records = writer.abort()
                    log.warning("event=stopped task=%s signal=%s shards_written=%d", task.id, stop.signum, len(records))
                    return RunResult(records=records, stats=None, engine=engine, stopped=True,
                                     phases=ledger.log_summary(task.id))  # fmt: skip
                if last is not None:
                    _wait(last)
                ledger.enter("tail")
                records = writer.finish()
            except BaseException as failure:
                # Stop the writer's threads; the original error is the one worth reporting.
                try:
                    writer.abort()
                except Exception as secondary:  # already failing: log a different second failure, raise the first
                    if secondary is not failure:
                        log.warning("event=writer_abort_failed error=%r", secondary)
                # An out-of-memory surfaces where the step's results are awaited (here, or in the writer's copy):
                # name the knob to turn instead of XLA's trace.
                named = engine.memory_error(failure)
                if named is not None and named is not failure:
                    raise named from failure
                raise
    finally:
        if batches is not None:
            batches.close()
        display.close()
        progress.close()

    stats = records[-1].get("stats") if records else None
    log.info(
        "event=task_done task=%s shards=%d stats=%s compiled_programs=%s",
        task.id, len(records), json.dumps(stats), getattr(engine, "compiled_programs", None),
    )  # fmt: skip
    return RunResult(records=records, stats=stats, engine=engine, phases=ledger.log_summary(task.id))


def _wait(outputs: Any) -> None:
    """Block until one step's outputs (and its non-finite counts) are computed."""
    import jax

    jax.block_until_ready([*outputs.values(), getattr(outputs, "nonfinite", None)])
