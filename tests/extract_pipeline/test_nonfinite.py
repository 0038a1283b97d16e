"""Activations that overflow the output dtype are never stored silently: the row is skipped and counted with a reason
naming the tensor (`on_bad_row: skip`), or the task fails with exit 65 naming it (`fail`).

The model is the tiny Qwen2 with one token's embedding scaled by 1e6: in bfloat16 compute that is fine, but the
residual stream carries it into `layer_1`, past float16's largest value (65504), in the rows holding that token only.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np

from extract.batching import Tokenizer
from activations.reader import open_activations
from extract.phases import is_goodput_counter
from tests.extract_pipeline.conftest import ConsumeRun

TEXTS = ["the river and the forest", "water § energy", "students learning mathematics", "one two three"]


def overflowing_model(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """A copy of `source` whose embedding of the first token of "§" is a million times larger."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(source, target)
    tokenizer = Tokenizer(target, 128)
    (token, *_), *others = tokenizer.encode(["§"] + [t for t in TEXTS if "§" not in t])
    assert all(token not in ids for ids in others), "the scaled token must be in one row only"
    weights = load_file(str(target / "model.safetensors"))
    weights["model.embed_tokens.weight"][token] *= 1e6
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def job_and_task(model: pathlib.Path, tmp_path: pathlib.Path, **overrides) -> tuple[dict, dict]:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    job = {"model": str(model), "data_files": [str(rows)], "layers": [1, -1], "max_seq_len": 32, "batch_size": 4,
           "shard_size": 4, "buckets": [32], "dtype": "fp16", **overrides}  # fmt: skip
    return job, {"id": "t", "files": [{"path": str(rows), "base": 0, "start": 0, "end": len(TEXTS)}]}


def test_a_row_whose_fp16_activations_overflow_is_skipped_and_counted_naming_the_layer(tmp_path, tiny_models,
                                                                                        run_consume):  # fmt: skip
    model = overflowing_model(tiny_models["qwen2"], tmp_path / "model")
    job, task = job_and_task(model, tmp_path)
    spec = ConsumeRun(workdir=tmp_path, job=job, task=task, output=str(tmp_path / "out"))
    proc = run_consume(spec)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (record,) = spec.records()
    counted = {k: v for k, v in record["counters"].items() if not is_goodput_counter(k)}  # the phases: test_goodput
    assert counted == {"skipped_rows": 1, "non_finite_rows": 1}
    (entry,) = record["skipped"]
    assert entry["sample_id"] == 1 and entry["row"] == 1 and entry["reason"] == "non_finite"
    assert entry["detail"].startswith("not finite in float16: layer_1 (") and "layer_2" not in entry["detail"]
    assert record["stats"]["skipped_rows"] == 1 and record["stats"]["samples"] == 3
    acts = open_activations(str(tmp_path / "out"))
    assert list(acts.sample_ids()) == [0, 2, 3]
    for layer in acts.layers:
        assert np.isfinite(np.asarray(acts.layer(layer), np.float32)).all()


def test_with_on_bad_row_fail_an_fp16_overflow_exits_65_naming_the_layer(tmp_path, tiny_models, run_consume):
    model = overflowing_model(tiny_models["qwen2"], tmp_path / "model")
    job, task = job_and_task(model, tmp_path, on_bad_row="fail")
    proc = run_consume(ConsumeRun(workdir=tmp_path, job=job, task=task, output=str(tmp_path / "out")))
    assert proc.returncode == 65, proc.stderr[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if "event=bad_input" in line]
    assert "sample 1 (data file" in line and "row 1): its activations are not finite in float16: layer_1 (" in line
    assert '"dtype": "bf16" or "fp32"' in line and "Traceback" not in proc.stderr
