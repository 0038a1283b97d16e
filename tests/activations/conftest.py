"""Shards written by the real ShardWriter from known activations, so every loader output can be checked exactly."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import ml_dtypes
import numpy as np
import pytest

import objectstore
from extract.batching import TokenizedSample, make_batches
from activations.sampling import TokenSampling
from extract.writer import ProgressLog, ShardWriter

BF16 = np.dtype(ml_dtypes.bfloat16)
HIDDEN = 16
LAYERS = (1, 3)


@dataclasses.dataclass
class Written:
    """A queue-like directory: shards under out/, a done marker per task under done/; and the truth."""

    root: pathlib.Path
    records: list[dict]
    token_ids: np.ndarray  # every stored token, in slice order
    positions: np.ndarray  # its position in its document
    layers: dict[int, np.ndarray]  # layer -> [n_tokens, HIDDEN] as stored (bf16)

    @staticmethod
    def row_key(layer_rows: np.ndarray) -> np.ndarray:
        """Each row's token number, recovered from columns 0 and 1 (see `activation_of`)."""
        wide = np.asarray(layer_rows, np.float32)
        return np.rint(wide[..., 0]).astype(np.int64) + 256 * np.rint(wide[..., 1]).astype(np.int64)


def activation_of(token_number: np.ndarray, layer: int, rng: np.random.Generator) -> np.ndarray:
    """Random activations whose columns 0 and 1 hold the token's running number (mod 256, div 256: integers below
    256 are exact in bfloat16), so that a row names its token."""
    rows = rng.standard_normal((len(token_number), HIDDEN)).astype(np.float32) * (1 + layer)
    rows[:, 0], rows[:, 1] = token_number % 256, token_number // 256
    return rows.astype(BF16)


def write_task(
    root: pathlib.Path, task: str, lengths: list[int], *, shard_size: int, seed: int, first_token: int = 0,
    sampling: TokenSampling | None = None,
) -> tuple[list[dict], np.ndarray, np.ndarray]:  # fmt: skip
    """A task's shards and done marker, written by the real ShardWriter (with `sampling`, only the positions it
    keeps); returns its records, and the token ids and positions of every token of its documents (kept or not)."""
    rng = np.random.default_rng(seed)
    queue = objectstore.open_store(str(root))  # the queue's store: its children share its bookkeeping
    store = queue.child(f"out/{task}")
    samples, start = [], first_token
    token_ids, positions = [], []
    for i, n in enumerate(lengths):
        ids = rng.integers(0, 50, n).astype(np.int32)
        samples.append(TokenizedSample(i, 1000 * seed + i, ids))
        token_ids.append(ids)
        positions.append(np.arange(n))
    numbers = {s.position: np.arange(start + sum(lengths[:k]), start + sum(lengths[: k + 1])) for k, s in enumerate(samples)}
    writer = ShardWriter(
        store=store, layers=LAYERS, out_dtype=BF16, start=0, end=len(lengths), shard_size=shard_size,
        metadata={"format": "activations/v1", "hidden_size": str(HIDDEN), "layers": json.dumps(list(LAYERS))},
        progress=ProgressLog(None), streams=2, sampling=sampling,
    )  # fmt: skip
    for batch in make_batches(samples, batch_size=4, buckets=(8, 16, 64), pad_id=0):
        if batch.token_ids is None:
            writer.submit(batch, {})
            continue
        hidden = {}
        for layer in LAYERS:
            out = np.zeros((*batch.token_ids.shape, HIDDEN), BF16)
            for row, s in enumerate(batch.samples):
                out[row, : s.n_tokens] = activation_of(numbers[s.position], layer, rng)
            hidden[layer] = out
        writer.submit(batch, hidden)
    records = writer.finish()
    queue.create(f"done/{task}.json", json.dumps({"task": task, "outputs": records}).encode())
    return records, np.concatenate(token_ids), np.concatenate(positions)


@pytest.fixture(scope="session")
def written(tmp_path_factory) -> Written:
    """Two tasks, 12 shards, 221 tokens; documents of uneven lengths, empty ones included."""
    root = tmp_path_factory.mktemp("job")
    rng = np.random.default_rng(5)
    records, ids, positions = [], [], []
    first = 0
    for t, seed in (("t0", 1), ("t1", 2)):
        lengths = [int(n) for n in rng.integers(0, 12, 20)]
        lengths[3] = 0
        task_records, task_ids, task_positions = write_task(root, t, lengths, shard_size=3, seed=seed, first_token=first)
        first += sum(lengths)
        records += task_records
        ids.append(task_ids)
        positions.append(task_positions)
    from activations.reader import open_activations

    acts = open_activations(str(root))
    layers = {layer: acts.layer(layer) for layer in LAYERS}
    return Written(root, records, np.concatenate(ids), np.concatenate(positions), layers)


@dataclasses.dataclass
class SampledJob:
    """A job written with token sampling: which tokens were stored, and the truth about every token."""

    root: pathlib.Path
    records: list[dict]
    stored: np.ndarray  # the running numbers of the stored tokens, in slice order
    token_ids: np.ndarray  # by running number: every token of the documents, stored or not
    positions: np.ndarray  # by running number: its position in its document


@pytest.fixture(scope="session")
def sampled(tmp_path_factory) -> SampledJob:
    """One task of documents of 0 to 40 tokens written with `token_sample` 0.5 and `drop_first` 1 (format v2:
    the shards hold `positions`), about 200 stored tokens in 7 shards."""
    root = tmp_path_factory.mktemp("sampled")
    lengths = [int(n) for n in np.random.default_rng(8).integers(0, 40, 20)]
    sampling = TokenSampling(0.5, 1, 7)
    records, ids, positions = write_task(root, "t0", lengths, shard_size=3, seed=3, sampling=sampling)
    starts = np.cumsum([0, *lengths])
    stored = np.concatenate([starts[i] + sampling.kept(3000 + i, n) for i, n in enumerate(lengths)])
    return SampledJob(root, records, stored, ids, positions)


@dataclasses.dataclass
class ExtractedJob:
    queue: pathlib.Path  # done/t0.json names the shards consume.py wrote under out/
    layer: int
    hidden: int
    num_hidden_layers: int


@pytest.fixture(scope="session")
def extracted_job(tmp_path_factory) -> ExtractedJob:
    """`make run`'s model (tools/local_run.py: a random Qwen2, hidden 128, 4 layers, GQA 4/2, a trained tokenizer) run
    by the real consume.py over one task of FineWeb-like rows; its progress records become the task's done marker."""
    import os
    import subprocess
    import sys

    from extract.tiny import write_fineweb_like_parquet, write_tiny_qwen
    from tests.workers import REPO

    root = tmp_path_factory.mktemp("extracted")
    model = write_tiny_qwen(root / "model", model_type="qwen2", hidden=128, layers=4, heads=4, kv_heads=2, vocab=512)
    (parquet,) = write_fineweb_like_parquet(root / "data", n_files=1, rows_per_file=[96], seed=1)
    job = {"model": str(model), "data_files": [str(parquet)], "layers": [2], "max_seq_len": 128, "batch_size": 16,
           "shard_size": 32, "buckets": [32, 128]}  # fmt: skip
    task = {"id": "t0", "files": [{"path": str(parquet), "base": 0, "start": 0, "end": 96}]}
    (root / "job.json").write_text(json.dumps(job))
    (root / "task.json").write_text(json.dumps(task))
    queue = objectstore.open_store(str(root / "queue"))
    progress = root / "progress.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    env = {k: v for k, v in env.items() if not k.startswith("SPAWN_")}
    result = subprocess.run(
        [sys.executable, "consume.py", "--job-file", str(root / "job.json"), "--task-file", str(root / "task.json"),
         "--output", str(root / "queue" / "out" / "t0" / "1"), "--progress-file", str(progress)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in progress.read_text().splitlines()]
    queue.create("done/t0.json", json.dumps({"task": "t0", "outputs": records}).encode())
    return ExtractedJob(root / "queue", layer=2, hidden=128, num_hidden_layers=4)
