"""The parallel shard writer: shards cut by bytes, uploads in parallel with records in order, no copy at the store."""

from __future__ import annotations

import json
import threading
import time

import ml_dtypes
import numpy as np

import objectstore
from extract.batching import ShardBounds, TokenizedSample, make_batches, split_at_shard_cuts
from extract.reader import open_activations
from extract.writer import ProgressLog, ShardWriter, crc32c_b64

BF16 = np.dtype(ml_dtypes.bfloat16)
HIDDEN = 8
LAYERS = (1, 3)
LENGTHS = [3, 8, 0, 1, 5, 2, 7, 0, 4, 6, 9, 1, 1, 2]


def fake_hidden(batch, layer: int) -> np.ndarray:
    """Activations that encode (token id, layer, column), so a misplaced row is visible."""
    ids = batch.token_ids.astype(np.float32)[:, :, None]
    return (ids * 10 + layer + np.arange(HIDDEN, dtype=np.float32) / 16).astype(BF16)


def batches_of(lengths, *, start=0, window=4, shard_size=100, shard_tokens=None):
    """Batches as `batches_for_slice` forms them: windows aligned to `window`, cut at shard boundaries."""
    samples = [
        TokenizedSample(start + i, 500 + start + i, np.arange(1, n + 1, dtype=np.int32) + start + i)
        for i, n in enumerate(lengths)
    ]
    bounds = ShardBounds(start, shard_size, shard_tokens)
    batches, i = [], 0
    while i < len(samples):
        position = samples[i].position
        stop = min((position // window + 1) * window, (position // shard_size + 1) * shard_size) - start
        for part in split_at_shard_cuts(samples[i:stop], bounds):
            batches += make_batches(part, batch_size=2, buckets=(4, 8, 16), pad_id=0)
        i = stop
    return batches


def write(store, lengths, *, start=0, shard_size=100, shard_tokens=None, streams=None, progress=None):
    writer = ShardWriter(
        store=store, layers=LAYERS, out_dtype=BF16, start=start, end=start + len(lengths), shard_size=shard_size,
        metadata={"format": "activations/v1", "hidden_size": str(HIDDEN), "layers": json.dumps(list(LAYERS))},
        progress=progress or ProgressLog(None), shard_tokens=shard_tokens, streams=streams,
    )  # fmt: skip
    for batch in batches_of(lengths, start=start, shard_size=shard_size, shard_tokens=shard_tokens):
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


def test_run_resumed_at_a_size_cut_forms_the_same_batches_and_shards():
    full = batches_of(LENGTHS, shard_tokens=10)
    bounds = ShardBounds(0, 100, 10)
    cuts = [i for i, n in enumerate(LENGTHS) if bounds.starts_shard(i, n)]
    resume_at = cuts[2]
    resumed = batches_of(LENGTHS[resume_at:], start=resume_at, shard_tokens=10)
    tail = [b for b in full if all(s.position >= resume_at for s in b.samples + b.empty)]
    assert len(tail) == len(resumed)
    for x, y in zip(tail, resumed):
        assert [s.position for s in x.samples] == [s.position for s in y.samples]
        assert np.array_equal(x.token_ids, y.token_ids)


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
        time.sleep(delay)
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
