"""consume.py end to end, as a real subprocess: by hand, resumed after SIGKILL, stopped by SIGTERM, on gs://."""

from __future__ import annotations

import json
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow.parquet as pq
import pytest

from activations.reader import open_activations
from extract.writer import crc32c_b64
from tests.extract_pipeline.conftest import (
    REPO,
    ConsumeRun,
    base_job,
    killed_after_two_shards,
    wait_for_records,
    write_json,
)

#: 80 samples over all three files, so the slice crosses two file boundaries; 5 shards of 16.
MAIN_SLICE = [(0, 70, 90), (1, 0, 50), (2, 0, 10)]


def texts_by_sample_id(corpus) -> dict[int, str]:
    texts = {}
    for path, base in zip(corpus.files, corpus.bases):
        for row, text in enumerate(pq.read_table(path, columns=["text"]).column("text").to_pylist()):
            texts[base + row] = text
    return texts


def expected_ids(corpus, ranges) -> list[int]:
    return [corpus.bases[i] + r for i, start, end in ranges for r in range(start, end)]


def assert_tiles(records: list[dict], n_samples: int) -> None:
    """Records cover [0, n_samples) exactly once, in order, and only the last is final."""
    spans = [(r["sample_start"], r["sample_end"]) for r in records]
    assert spans[0][0] == 0 and spans[-1][1] == n_samples
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
    assert records[-1].get("final") is True and not any(r.get("final") for r in records[:-1])


@pytest.fixture(scope="module")
def qwen2_reference(tmp_path_factory, tiny_models, corpus, run_consume):
    """An uninterrupted bf16 run over MAIN_SLICE: the by-hand test checks it, the resume test compares to it."""
    workdir = tmp_path_factory.mktemp("qwen2-reference")
    spec = ConsumeRun(
        workdir=workdir,
        job=base_job(tiny_models["qwen2"], corpus),
        task={"id": "t000001", "files": corpus.slice_files(MAIN_SLICE)},
        output=str(workdir / "out"),
    )
    proc = run_consume(spec)
    assert proc.returncode == 0, proc.stderr
    return spec


def test_by_hand_qwen2_run_writes_shards_the_reader_reads_back(qwen2_reference, tiny_models, corpus):
    from transformers import AutoTokenizer

    records = qwen2_reference.records()
    assert_tiles(records, 80)
    assert [r["samples"] for r in records] == [16] * 5
    stats = records[-1]["stats"]
    assert stats["samples"] == 80 and stats["tokens"] == sum(r["tokens"] for r in records) and stats["mfu"] is None
    for r in records:
        payload = pathlib.Path(r["shard"]).read_bytes()
        assert r["bytes"] == len(payload) and r["crc32c"] == crc32c_b64(payload)

    acts = open_activations(qwen2_reference.output)
    assert acts.layers == (1, 2) and acts.num_samples == 80
    assert acts.metadata["model_type"] == "qwen2" and acts.metadata["task"] == "t000001"
    assert acts.metadata["job"]["layers"] == [1, -1] and acts.metadata["dtype"] == "bf16"
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models["qwen2"]))
    texts = texts_by_sample_id(corpus)
    samples = list(acts.samples())
    assert [s.sample_id for s in samples] == expected_ids(corpus, MAIN_SLICE)
    for s in samples:
        expected = tokenizer(texts[s.sample_id], add_special_tokens=False)["input_ids"][:128]
        assert s.token_ids.tolist() == expected
        for layer in (1, 2):
            assert s.layers[layer].shape == (len(expected), 64) and s.layers[layer].dtype.name == "bfloat16"
    # No padding stored: the token count is the sum of the true lengths, and empty texts have empty spans.
    assert acts.num_tokens == sum(len(s.token_ids) for s in samples) == stats["tokens"]
    assert any(len(s.token_ids) == 0 for s in samples) and any(len(s.token_ids) == 128 for s in samples)
    assert np.isfinite(acts.layer(2).astype(np.float32)).all()


def test_by_hand_qwen3_fp32_run_matches_transformers(tmp_path, tiny_models, corpus, run_consume):
    """Each stored sample holds the hidden states transformers computes for that sample's text alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ranges = [(2, 30, 70)]
    spec = ConsumeRun(
        workdir=tmp_path,
        job=base_job(tiny_models["qwen3"], corpus, layers=[0, 2], dtype="fp32", compute_dtype="fp32", shard_size=12),
        task={"id": "t000002", "files": corpus.slice_files(ranges)},
        output=str(tmp_path / "out"),
    )
    proc = run_consume(spec)
    assert proc.returncode == 0, proc.stderr
    assert_tiles(spec.records(), 40)

    acts = open_activations(spec.output)
    assert acts.layers == (0, 2) and acts.metadata["model_type"] == "qwen3"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models["qwen3"]), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models["qwen3"]))
    texts = texts_by_sample_id(corpus)
    samples = list(acts.samples())
    assert [s.sample_id for s in samples] == expected_ids(corpus, ranges)
    compared = 0
    for s in samples:
        ids = tokenizer(texts[s.sample_id], add_special_tokens=False)["input_ids"][:128]
        assert s.token_ids.tolist() == ids
        if not ids:
            continue
        with torch.no_grad():
            hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for layer in (0, 2):
            assert s.layers[layer].dtype == np.float32
            np.testing.assert_allclose(s.layers[layer], hidden[layer][0].numpy(), rtol=2e-4, atol=2e-4)
        compared += 1
    assert compared > 30


def test_resume_after_sigkill_covers_every_sample_once_with_identical_activations(
    tmp_path, tiny_models, corpus, qwen2_reference, start_consume, run_consume, gcs, gcs_bucket, gcs_client
):
    """Kill -9 after two committed shards, resume from the committed records, compare with the uninterrupted run.

    The resumed run starts at a shard boundary, and batching windows are cut at shard boundaries, so it
    forms exactly the batches the uninterrupted run formed there: activations are bit-identical on CPU.
    """
    committed, second = killed_after_two_shards(tmp_path, qwen2_reference.job, qwen2_reference.task, gcs, gcs_bucket,
                                                start_consume)  # fmt: skip
    assert len(committed) < 5
    done = run_consume(second)
    assert done.returncode == 0, done.stderr
    resumed = second.records()
    assert resumed[0]["sample_start"] == committed[-1]["sample_end"]
    assert resumed[-1]["stats"]["samples"] == 80 - committed[-1]["sample_end"]
    union = committed + resumed
    assert_tiles(union, 80)

    marker = write_json(tmp_path / "done" / "t000001.json", {"task": "t000001", "fencing_token": 2, "worker": "w",
                                                              "attempt": 2, "outputs": union,
                                                              "completed_at": "2025-01-01T00:00:00Z"})  # fmt: skip
    got = list(open_activations(str(marker)).samples())
    want = list(open_activations(qwen2_reference.output).samples())
    assert [s.sample_id for s in got] == [s.sample_id for s in want] == expected_ids(corpus, MAIN_SLICE)
    for g, w in zip(got, want):
        assert np.array_equal(g.token_ids, w.token_ids)
        for layer in (1, 2):
            assert g.layers[layer].dtype == w.layers[layer].dtype
            assert np.array_equal(g.layers[layer].view(np.uint16), w.layers[layer].view(np.uint16)), g.sample_id


def test_sigterm_stops_within_seconds_keeping_only_complete_shards(
    tmp_path, qwen2_reference, start_consume, gcs, gcs_bucket, gcs_client
):
    import objectstore

    gcs.faults.add_latency(0.5, kind="write")
    # Small shards: with bounded queues the main loop is still dispatching when the first record lands.
    spec = ConsumeRun(workdir=tmp_path, job={**qwen2_reference.job, "shard_size": 4}, task=qwen2_reference.task,
                      output=f"gs://{gcs_bucket}/out/t000001/1")  # fmt: skip
    proc = start_consume(spec)
    wait_for_records(spec, proc, 1)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 143, spec.stderr_file.read_text()
    took = time.monotonic() - signalled
    assert took < 8, f"exited {took:.1f} s after SIGTERM:\n{spec.stderr_file.read_text()}"
    records = spec.records()
    assert records and records[0]["sample_start"] == 0 and not any(r.get("final") for r in records)
    assert all(a["sample_end"] == b["sample_start"] for a, b in zip(records, records[1:]))
    store = objectstore.open_store(spec.output, client=gcs_client)
    stored = {store.url(e.name): e for e in store.list("")}
    assert set(stored) == {r["shard"] for r in records}, "every stored shard is complete and recorded"
    for r in records:
        assert crc32c_b64(store.read(r["shard"].rsplit("/", 1)[1]).data) == r["crc32c"]


def test_sigterm_while_the_model_loads_exits_143_at_once(tmp_path, qwen2_reference, start_consume):
    spec = ConsumeRun(
        workdir=tmp_path, job=qwen2_reference.job, task=qwen2_reference.task, output=str(tmp_path / "out")
    )
    proc = start_consume(spec)
    deadline = time.monotonic() + 120
    while "event=task_start" not in spec.stderr_file.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, spec.stderr_file.read_text()
        time.sleep(0.01)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 143, spec.stderr_file.read_text()
    assert time.monotonic() - signalled < 8
    assert spec.records() == []


def test_gs_data_and_gs_output_through_spawn_environment(
    tmp_path, tiny_models, corpus, consume_env, gcs, gcs_bucket, gcs_client
):
    """Tasks planned from footers on gs://, then consume.py driven only by SPAWN_* variables, on gs:// both ways."""
    bucket = gcs_client.bucket(gcs_bucket)
    for path in corpus.files:
        bucket.blob(f"data/{path.name}").upload_from_filename(str(path))
    job = base_job(tiny_models["qwen2"], corpus, data_files=[f"gs://{gcs_bucket}/data/*.parquet"], shard_size=20)
    job_file = write_json(tmp_path / "job.json", job)
    plan = subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_tasks.py"), str(job_file), "--rows-per-task", "60",
         "-o", str(tmp_path / "tasks.jsonl")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    tasks = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert [sum(f["end"] - f["start"] for f in t["files"]) for t in tasks] == [60, 60, 60, 40]
    task = tasks[1]  # rows 60..120: the end of file 0 and the start of file 1
    assert [f["path"] for f in task["files"]] == [f"gs://{gcs_bucket}/data/{n}_00000.parquet" for n in ("000", "001")]

    output = f"gs://{gcs_bucket}/queue/out/{task['id']}/7"
    env = {
        "SPAWN_TASK_ID": task["id"], "SPAWN_ATTEMPT": "1",
        "SPAWN_JOB_FILE": str(job_file), "SPAWN_TASK_FILE": str(write_json(tmp_path / "task.json", task)),
        "SPAWN_RESUME_FILE": str(write_json(tmp_path / "resume.json", {"task": task["id"], "attempt": 1,
                                                                       "progress": []})),
        "SPAWN_PROGRESS_FILE": str(tmp_path / "progress.jsonl"), "SPAWN_OUTPUT": output,
    }  # fmt: skip
    proc = subprocess.run([sys.executable, "consume.py"], cwd=REPO, env={**consume_env(), **env},
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert_tiles(records, 60)
    assert all(r["shard"].startswith(output + "/") for r in records)

    marker = {"task": task["id"], "fencing_token": 7, "worker": "w", "attempt": 1, "outputs": records,
              "completed_at": "2025-01-01T00:00:00Z"}  # fmt: skip
    bucket.blob(f"queue/done/{task['id']}.json").upload_from_string(json.dumps(marker))
    acts = open_activations(f"gs://{gcs_bucket}/queue/done/{task['id']}.json")
    assert list(acts.sample_ids()) == list(range(60, 120))
    assert acts.num_tokens == sum(r["tokens"] for r in records)
    assert list(open_activations(output).sample_ids()) == list(range(60, 120))


# -- bad input: exit 65, one line naming the field ---------------------------------------------------------------


def _broken_model(tiny_models, tmp_path, how: str) -> pathlib.Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_models["qwen2"], model)
    if how in ("model_type", "rope_conflict"):
        config = json.loads((model / "config.json").read_text())
        if how == "model_type":
            config["model_type"] = "deepseek_v3"  # MoE with latent attention: not supported
        else:  # transformers would run YaRN at theta 10000 here (tests/extract_model/test_rope_and_windows.py)
            config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
            config["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
        (model / "config.json").write_text(json.dumps(config))
    elif how == "weights":
        (model / "model.safetensors").unlink()
    return model


BAD_INPUTS = {
    # case: (what to break, text that must appear in the error line)
    "unknown-model-type": ("model_type", "model_type"),
    "rope-scaling-beside-rope-parameters": ("rope_conflict", "rope_scaling"),
    "missing-weights": ("weights", "safetensors"),
    "layer-out-of-range": ("layers", "layers"),
    "missing-text-field": ("text_field", "text_field"),
    "non-string-text-column": ("int_column", "text_field"),
    "non-string-text-jsonl-row": ("jsonl", "text_field"),
    "empty-slice": ("empty", "task.files"),
    "missing-data-file": ("missing_file", "does-not-exist.parquet"),
    "corrupt-data-file": ("corrupt_file", "not a readable parquet"),
    "job-field-typo": ("typo", "layer"),
    "bad-task-field": ("task_end", "task.files[0].end"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_65_naming_the_field(case, tmp_path, tiny_models, corpus, run_consume):
    how, needle = BAD_INPUTS[case]
    job = base_job(tiny_models["qwen2"], corpus)
    task = {"id": "t000009", "files": corpus.slice_files([(1, 0, 8)])}
    if how in ("model_type", "rope_conflict", "weights"):
        job["model"] = str(_broken_model(tiny_models, tmp_path, how))
    elif how == "layers":
        job["layers"] = [1, 7]
    elif how == "text_field":
        job["text_field"] = "body"
    elif how == "int_column":
        job["text_field"] = "int_score"
    elif how == "jsonl":
        job["on_bad_row"] = "fail"  # by default a bad row is skipped (tests/extract_pipeline/test_bad_rows.py)
        rows = tmp_path / "rows.jsonl"
        rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["one", "two", 3, "four"]))
        task["files"] = [{"path": str(rows), "base": 0, "start": 0, "end": 4}]
    elif how == "empty":
        task["files"][0]["end"] = task["files"][0]["start"]
    elif how == "missing_file":
        task["files"][0]["path"] = str(tmp_path / "does-not-exist.parquet")
    elif how == "corrupt_file":
        corrupt = tmp_path / "corrupt.parquet"
        corrupt.write_bytes(b"PAR1 this is not parquet")
        task["files"][0]["path"] = str(corrupt)
    elif how == "typo":
        job["layer"] = job.pop("layers")
    elif how == "task_end":
        task["files"][0]["end"] = "ten"
    spec = ConsumeRun(workdir=tmp_path, job=job, task=task, output=str(tmp_path / "out"))
    proc = run_consume(spec)
    assert proc.returncode == 65, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "event=bad_input" in line]
    assert needle in line, line
    assert not spec.records() and not list((tmp_path / "out").glob("*.safetensors"))
