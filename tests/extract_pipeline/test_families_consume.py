"""Llama, Mistral, Gemma 2 and Gemma 3 checkpoints saved by transformers go through consume.py keeping every hook site
of every layer and every hidden state, and the shards match transformers' own modules within the documented bound.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from activations.format import SITES, HookPoint
from activations.reader import open_activations
from extract.tiny import write_tiny_tokenizer
from tests.extract_model.families import write_family_model
from tests.extract_model.test_family_parity import assert_float32_within_bound
from tests.extract_pipeline.conftest import ConsumeRun

TEXTS = ["the river and the forest", "", "students learning mathematics and science in school today",
         "water energy health research climate", "café naïve über 学习", "one two"]  # fmt: skip


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2", "gemma3_text"])
def test_a_transformers_checkpoint_goes_through_consume_and_matches_at_every_site(model_type, tmp_path, run_consume):
    model = write_family_model(tmp_path / "model", model_type, seed=5)
    write_tiny_tokenizer(tmp_path / "model", vocab=300, seed=5)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    layers = model.num_hidden_layers
    spec = ConsumeRun(
        workdir=tmp_path,
        job={"model": str(model.path), "data_files": [str(rows)], "layers": list(range(layers + 1)),
             "sites": {site: list(range(layers)) for site in SITES}, "max_seq_len": 32, "batch_size": 4,
             "shard_size": 4, "buckets": [32], "dtype": "fp32", "compute_dtype": "fp32"},
        task={"id": "t", "files": [{"path": str(rows), "base": 0, "start": 0, "end": len(TEXTS)}]},
        output=str(tmp_path / "out"),
    )  # fmt: skip
    proc = run_consume(spec)
    assert proc.returncode == 0, proc.stderr[-3000:]
    acts = open_activations(spec.output)
    assert acts.metadata["model_type"] == model_type and acts.num_samples == len(TEXTS)
    assert acts.sites == {site: tuple(range(layers)) for site in SITES}
    errors = {}
    for sample in acts.samples():
        if not len(sample.token_ids):
            continue
        ids = sample.token_ids.tolist()
        theirs, wide = model.reference(ids), model.reference(ids, torch.float64)
        for output, values in sample.outputs.items():
            key = output.key if isinstance(output, HookPoint) else f"layer_{output}"
            mine = float(np.abs(values.astype(np.float64) - wide[output]).max())
            own = float(np.abs(theirs[output] - wide[output]).max())
            before = errors.get(key, (0.0, 0.0, 0.0))
            errors[key] = (max(before[0], mine), max(before[1], own), max(before[2], float(np.abs(wide[output]).max())))
    assert len(errors) == (layers + 1) + layers * len(SITES)
    assert_float32_within_bound(errors)
