"""A packed run (job.packing) against an unpacked one: the same samples, offsets, sample ids and token ids in the
same shards, activations within the float32 padding bound; and shards cut by bytes in a real run."""

from __future__ import annotations

import numpy as np

from extract.consumer import RunInputs, run
from extract.job import Job, Task
from activations.reader import open_activations
from tests.extract_pipeline.conftest import base_job

FLOAT32_ATOL = 1e-5  # tests/extract_model/test_numerics.py's bound for a change of row layout


def test_packed_run_writes_the_same_samples_and_activations_as_an_unpacked_one(tmp_path, tiny_models, corpus):
    task = Task.from_dict({"id": "t000001", "files": corpus.slice_files([(0, 10, 90), (1, 0, 20)])})
    spec = base_job(tiny_models["qwen2"], corpus, dtype="fp32", compute_dtype="fp32", shard_size=40)
    plain = run(RunInputs(job=Job.from_dict(spec), task=task, output_url=str(tmp_path / "plain")))
    packed_job = Job.from_dict({**spec, "packing": True})
    packed = run(RunInputs(job=packed_job, task=task, output_url=str(tmp_path / "packed")))
    keys = ("sample_start", "sample_end", "samples", "tokens")
    assert [{k: r[k] for k in keys} for r in packed.records] == [{k: r[k] for k in keys} for r in plain.records]
    a, b = open_activations(str(tmp_path / "plain")), open_activations(str(tmp_path / "packed"))
    assert np.array_equal(a.sample_ids(), b.sample_ids()) and np.array_equal(a.offsets(), b.offsets())
    assert np.array_equal(a.token_ids(), b.token_ids())
    for layer in a.layers:
        np.testing.assert_allclose(b.layer(layer), a.layer(layer), atol=FLOAT32_ATOL, rtol=0)


def test_shard_bytes_cuts_shards_without_changing_activations(tmp_path, tiny_models, corpus):
    task = Task.from_dict({"id": "t000002", "files": corpus.slice_files([(0, 0, 60)])})
    spec = base_job(tiny_models["qwen2"], corpus, shard_size=60)
    whole = run(RunInputs(job=Job.from_dict(spec), task=task, output_url=str(tmp_path / "whole")))
    # 2 layers x 64 hidden x 2 bytes + 4 = 260 bytes per token: at most 100 tokens per shard.
    cut = run(RunInputs(job=Job.from_dict({**spec, "shard_bytes": 26000}), task=task, output_url=str(tmp_path / "cut")))
    assert len(whole.records) == 1 and len(cut.records) > 3
    assert all(r["tokens"] <= 100 or r["samples"] == 1 for r in cut.records)
    a, b = open_activations(str(tmp_path / "whole")), open_activations(str(tmp_path / "cut"))
    assert np.array_equal(a.sample_ids(), b.sample_ids()) and np.array_equal(a.offsets(), b.offsets())
    for layer in a.layers:
        assert np.array_equal(a.layer(layer).view(np.uint16), b.layer(layer).view(np.uint16))
