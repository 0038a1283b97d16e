"""The whole pipeline as a user runs it: make_tasks, submit, spawn.py workers running consume.py, status, merge, reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from objectstore import open_store
from taskqueue import layout
from tests.e2e.conftest import CONSUMER, committed_samples, make_job, plan_and_submit, tool
from tests.workers import REPO, Workers, markers


def test_local_run_keeping_mlp_out_and_attn_out_reads_back_every_sample_into_the_loader_and_saelens(tmp_path):
    """`make run`'s script, end to end on the embedded default (spawn.py workers running consume.py on a local
    bucket), keeping two hook sites besides the hidden states; then the loader and SAELens read what it wrote."""
    import torch
    from sae_lens.training.activations_store import ActivationsStore

    from activations.loader import ActivationLoader
    from activations.reader import open_activations

    work = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "tools/local_run.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "LOCAL_RUN_DIR": str(work), "WORKERS": "2", "ROWS_PER_TASK": "80",
             "SITES": "mlp_out:1,2;attn_out:1"},  # fmt: skip
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "read back 320 samples" in result.stdout
    assert "complete: every task has a done or failed marker" in result.stdout
    assert "layer_-1" not in result.stdout and "layer_4" in result.stdout  # final norm is index num_layers
    assert "mlp_out_2" in result.stdout and "attn_out_1" in result.stdout

    queue = str(work / "queue")
    acts = open_activations(queue)
    assert acts.sites == {"attn_out": (1,), "mlp_out": (1, 2)} and acts.num_samples == 320
    # The loader gives every token of a site once (compared as a multiset: tasks may be read in any order).
    for site, layer in (("mlp_out", 2), ("attn_out", 1)):
        truth = np.asarray(acts.layer(layer, site=site), np.float32)
        with ActivationLoader(queue, site=site, layers=layer, batch_size=4096, shuffle=False) as loader:
            streamed = np.concatenate(list(loader))
        assert streamed.shape == truth.shape and not np.array_equal(truth, np.asarray(acts.layer(1, site="mlp_out")))
        assert sorted(map(bytes, streamed)) == sorted(map(bytes, truth))

    # local_run exported the first site it kept for SAELens; SAELens's own store reads it back under its hook name.
    summary = json.loads([line for line in result.stdout.splitlines() if line.startswith('{"directory"')][-1])
    assert summary["hook"] == "blocks.1.hook_attn_out" and summary["d_in"] == acts.hidden_size
    store = ActivationsStore(
        model=None, dataset=None, streaming=False, hook_name=summary["hook"], hook_head_index=None,
        context_size=16, d_in=summary["d_in"], n_batches_in_buffer=2, total_training_tokens=1000,
        store_batch_size_prompts=4, train_batch_size_tokens=32, prepend_bos=False, normalize_activations="none",
        device=torch.device("cpu"), dtype="float32", cached_activations_path=summary["directory"],
    )  # fmt: skip
    got, token_ids = store.get_raw_llm_batch()
    with ActivationLoader(queue, site="attn_out", layers=1, batch_size=64, shuffle=False,
                          return_token_ids=True) as loader:  # the export's order
        expected, expected_ids = next(loader)
    assert np.array_equal(got.numpy(), expected) and np.array_equal(token_ids.numpy(), expected_ids)


def test_pipeline_through_gcs_with_two_workers(tmp_path, gcs_client, gcs_bucket, tiny_model):
    from extract.tiny import write_fineweb_like_parquet

    # The dataset lives in the bucket too, so reading gs:// data is part of the run.
    bucket = gcs_client.bucket(gcs_bucket)
    data_urls = []
    for path in write_fineweb_like_parquet(tmp_path / "data", n_files=2, rows_per_file=[21, 17], seed=3):
        bucket.blob(f"data/{path.name}").upload_from_filename(str(path))
        data_urls.append(f"gs://{gcs_bucket}/data/{path.name}")
    queue = f"gs://{gcs_bucket}/jobs/e2e"
    job_file = make_job(tmp_path, tiny_model, data_urls)
    tasks = plan_and_submit(queue, job_file, rows_per_task=8)
    workers = Workers(queue, tmp_path)
    try:
        for w in range(2):
            workers.start(f"w{w}", "--lease-ttl", "60", "--idle-timeout", "20", consumer=CONSUMER)
        assert set(workers.wait(timeout=400).values()) == {0}
    finally:
        workers.kill_all()
    assert sorted(markers(queue, layout.DONE)) == sorted(t["id"] for t in tasks)
    samples, repeats = committed_samples(queue)
    assert repeats == 0 and sorted(samples) == list(range(38))
    tool("tools/merge.py", queue)
    index = json.loads(open_store(queue).read("index.json").data)
    assert index["totals"]["tasks"] == len(tasks) and index["totals"]["samples"] == 38


def test_bad_tasks_end_in_failed_with_reasons_while_good_tasks_finish(tmp_path, tiny_model):
    from extract.tiny import write_fineweb_like_parquet

    paths = [str(p) for p in write_fineweb_like_parquet(tmp_path / "data", n_files=1, rows_per_file=12, seed=4)]
    queue = str(tmp_path / "queue")
    job_file = make_job(tmp_path, tiny_model, paths)
    tasks = plan_and_submit(queue, job_file, rows_per_task=4)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 this is not a parquet file")
    store = open_store(queue)
    unreadable = {"id": "unreadable", "files": [{"path": str(broken), "base": 1000, "start": 0, "end": 5}]}
    store.create(layout.task_object("unreadable"), json.dumps(unreadable).encode())
    store.create(layout.task_object("nofiles"), json.dumps({"id": "nofiles"}).encode())
    workers = Workers(queue, tmp_path)
    try:
        workers.start("a", "--idle-timeout", "10", consumer=CONSUMER)
        workers.start("b", "--idle-timeout", "10", consumer=CONSUMER)
        assert set(workers.wait(timeout=300).values()) == {0}
    finally:
        workers.kill_all()
    assert sorted(markers(queue, layout.DONE)) == sorted(t["id"] for t in tasks)
    failed = markers(queue, layout.FAILED)
    assert sorted(failed) == ["nofiles", "unreadable"]
    assert "broken.parquet" in failed["unreadable"]["errors"][-1]["error"]
    assert "files" in failed["nofiles"]["errors"][-1]["error"]
    logs = workers.all_logs()
    assert logs.count("consumer_start task=unreadable") == 1 and logs.count("consumer_start task=nofiles") == 1
    view = json.loads(tool("tools/status.py", queue, "--json").stdout)
    assert view["failed"] == 2 and view["done"] == len(tasks) and view["complete"]
    assert "exit 65" in view["failed_reasons"]["unreadable"]
