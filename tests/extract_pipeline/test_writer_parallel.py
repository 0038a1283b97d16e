"""The parallel shard writer: shards cut by bytes, uploads in parallel with records in order, no copy at the store."""

from __future__ import annotations

import json
import threading
import time

import ml_dtypes
import numpy as np

import objectstore
from extract.batching import WINDOW_BATCHES, TokenizedSample, make_batches, window_bounds, window_start
from activations.reader import open_activations
from extract.writer import ProgressLog, ShardWriter, crc32c_b64

BF16 = np.dtype(ml_dtypes.bfloat16)
HIDDEN = 8
LAYERS = (1, 3)
LENGTHS = [3, 8, 0, 1, 5, 2, 7, 0, 4, 6, 9, 1, 1, 2]


def fake_hidden(batch, layer: int) -> np.ndarray:
    """Activations that encode (token id, layer, column), so a misplaced row is visible."""
    ids = batch.token_ids.astype(np.float32)[:, :, None]
    return (ids * 10 + layer + np.arange(HIDDEN, dtype=np.float32) / 16).astype(BF16)


def all_samples(lengths):
    return [TokenizedSample(p, 500 + p, np.arange(1, n + 1, dtype=np.int32) + p) for p, n in enumerate(lengths)]


def batches_of(lengths, *, start=0, shard_size=100):
    """Batches as `batches_for_slice` forms them for a run starting at `start`: from its window's start."""
    samples = all_samples(lengths)
    batches = []
    lo = window_start(start, 2, shard_size)
    for lo, hi in window_bounds(lo, len(lengths), WINDOW_BATCHES * 2, shard_size):
        batches += make_batches(samples[lo:hi], batch_size=2, buckets=(4, 8, 16), pad_id=0)
    return batches


def write(store, lengths, *, start=0, shard_size=100, shard_tokens=None, streams=None, progress=None):
    writer = ShardWriter(
        store=store, layers=LAYERS, out_dtype=BF16, start=start, end=len(lengths), shard_size=shard_size,
        metadata={"format": "activations/v1", "hidden_size": str(HIDDEN), "layers": json.dumps(list(LAYERS))},
        progress=progress or ProgressLog(None), shard_tokens=shard_tokens, streams=streams,
    )  # fmt: skip
    for batch in batches_of(lengths, start=start, shard_size=shard_size):
        hidden = {layer: fake_hidden(batch, layer) for layer in LAYERS} if batch.token_ids is not None else {}
        writer.submit(batch, hidden)
    return writer.finish()


def test_shards_cut_by_tokens_stay_under_the_limit_and_hold_the_same_activations(tmp_path):
    whole = write(objectstore.open_store(str(tmp_path / "whole")), LENGTHS)
    cut = write(objectstore.open_store(str(tmp_path / "cut")), LENGTHS, shard_tokens=10)
    assert len(whole) == 1 and len(cut) > 3
    starts = [r["sample_start"] for r in cut]
    assert starts == sorted(starts) and [r["sample_end"] for r in cut[:-1]] == starts[1:]
    for record in cut:
        assert record["tokens"] <= 10 or record["samples"] == 1  # one long document may exceed the limit alone
    a, b = open_activations(str(tmp_path / "whole")), open_activations(str(tmp_path / "cut"))
    for layer in LAYERS:
        assert np.array_equal(a.layer(layer), b.layer(layer))
    assert np.array_equal(a.sample_ids(), b.sample_ids()) and np.array_equal(a.offsets(), b.offsets())
    assert np.array_equal(a.token_ids(), b.token_ids())


def test_run_resumed_at_a_size_cut_recomputes_its_window_and_writes_the_same_later_shards(tmp_path):
    lengths = LENGTHS * 3
    full = write(objectstore.open_store(str(tmp_path / "full")), lengths, shard_tokens=10)
    resume_at = next(r["sample_start"] for r in full if r["sample_start"] % (WINDOW_BATCHES * 2))
    assert window_start(resume_at, 2, 100) < resume_at, "the cut lies inside a batching window"
    resumed = write(objectstore.open_store(str(tmp_path / "resumed")), lengths, start=resume_at, shard_tokens=10)
    tail = [r for r in full if r["sample_start"] >= resume_at]
    def same(records):
        return [(r["sample_start"], r["sample_end"], r["bytes"], r["crc32c"]) for r in records]

    assert same(resumed) == same(tail)
    assert resumed[-1]["stats"]["samples"] == len(lengths) - resume_at


class SlowFirstStore:
    """A real local store whose earlier puts take longer, so later shards finish uploading first."""

    def __init__(self, inner):
        self.inner = inner
        self.root_url = inner.root_url
        self.payload_types: list[type] = []
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()
        self._calls = 0

    def put(self, name, data, metadata=None):
        with self._lock:
            self._calls += 1
            delay = max(0.0, 0.3 - 0.1 * self._calls)
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.payload_types.append(type(data))
        time.sleep(delay)  # a slow store, the first puts slowest: what parallel writes must overlap
        try:
            return self.inner.put(name, data, metadata)
        finally:
            with self._lock:
                self.active -= 1

    def url(self, name):
        return self.inner.url(name)


def test_parallel_uploads_append_records_in_shard_order(tmp_path):
    store = SlowFirstStore(objectstore.open_store(str(tmp_path / "out")))
    progress_file = tmp_path / "progress.jsonl"
    records = write(store, LENGTHS, shard_size=3, streams=4, progress=ProgressLog(progress_file))
    assert store.max_active >= 2
    assert [json.loads(line) for line in progress_file.read_text().splitlines()] == records
    assert [r["sample_start"] for r in records] == list(range(0, len(LENGTHS), 3))
    for r in records:
        payload = (tmp_path / "out" / r["shard"].rsplit("/", 1)[1]).read_bytes()
        assert r["bytes"] == len(payload) and r["crc32c"] == crc32c_b64(payload)


def test_store_gets_a_view_of_the_shard_buffer_not_a_copy(tmp_path):
    store = SlowFirstStore(objectstore.open_store(str(tmp_path / "out")))
    write(store, LENGTHS, shard_size=5)
    assert store.payload_types and all(t is memoryview for t in store.payload_types)


def test_gcs_store_streams_a_memoryview_across_resumable_chunks(gcs_client, gcs_bucket):
    store = objectstore.open_store(f"gs://{gcs_bucket}/out", client=gcs_client)
    payload = np.random.default_rng(0).integers(0, 255, 9 * 1024 * 1024 + 17, dtype=np.uint8)  # over 8 MiB
    payload.setflags(write=False)
    store.put("big.bin", memoryview(payload))
    store.put("small.bin", memoryview(payload[:100]))
    assert store.read("big.bin").data == payload.tobytes()
    assert store.read("small.bin").data == payload[:100].tobytes()


def test_shard_buffers_are_reused_and_idle_ones_are_bounded():
    from extract.writer import _BufferPool

    pool = _BufferPool(keep=2)
    first = pool.take(1000)
    pool.give(first)
    assert pool.take(900) is first  # a stored shard's memory is written again, not freshly faulted in
    buffers = [pool.take(100) for _ in range(4)]
    for buffer in buffers:
        pool.give(buffer)
    assert len(pool._idle) == 2
