"""Llama, Mistral, Gemma 2, Gemma 3 and Qwen2-MoE checkpoints saved by transformers go through consume.py keeping
every hook site of every layer and every hidden state, and the shards match transformers' own modules within the
documented bound. Qwen2-MoE's layers differ: the router's sites on its mixture layers, `mlp_hidden` on its dense one;
its router sites read back through the loader and are named for SAELens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from activations.format import SITES, HookPoint
from activations.loader import ActivationLoader
from activations.reader import open_activations
from activations.saelens import hook_name
from extract.tiny import write_tiny_tokenizer
from tests.extract_model.families import write_family_model
from tests.extract_model.test_family_parity import assert_float32_within_bound
from tests.extract_pipeline.conftest import ConsumeRun

TEXTS = ["the river and the forest", "", "students learning mathematics and science in school today",
         "water energy health research climate", "café naïve über 学习", "one two"]  # fmt: skip


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2", "gemma3_text", "qwen2_moe"])
def test_a_transformers_checkpoint_goes_through_consume_and_matches_at_every_site(model_type, tmp_path, run_consume):
    model = write_family_model(tmp_path / "model", model_type, seed=5)
    write_tiny_tokenizer(tmp_path / "model", vocab=300, seed=5)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    layers = model.num_hidden_layers
    sites = {site: [layer for layer in range(layers) if site in model.layer_sites(layer)] for site in SITES}
    sites = {site: where for site, where in sites.items() if where}
    spec = ConsumeRun(
        workdir=tmp_path,
        job={"model": str(model.path), "data_files": [str(rows)], "layers": list(range(layers + 1)),
             "sites": sites, "max_seq_len": 32, "batch_size": 4,
             "shard_size": 4, "buckets": [32], "dtype": "fp32", "compute_dtype": "fp32"},
        task={"id": "t", "files": [{"path": str(rows), "base": 0, "start": 0, "end": len(TEXTS)}]},
        output=str(tmp_path / "out"),
    )  # fmt: skip
    proc = run_consume(spec)
    assert proc.returncode == 0, proc.stderr[-3000:]
    acts = open_activations(spec.output)
    assert acts.metadata["model_type"] == model_type and acts.num_samples == len(TEXTS)
    assert acts.sites == {site: tuple(where) for site, where in sites.items()}
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
    assert len(errors) == (layers + 1) + sum(map(len, sites.values()))
    assert_float32_within_bound(errors)
    if "expert_weights" in sites:  # the loader reads the router's sites; each token's weights sum to 1 or less
        layer = sites["expert_weights"][0]
        with ActivationLoader(spec.output, site="expert_weights", layers=layer, batch_size=8, shuffle=False) as loader:
            batch = np.asarray(next(loader))
        experts = model.torch_model.config.num_experts
        assert batch.shape == (8, experts) and ((batch != 0).sum(axis=1) == 2).all()
        assert (batch.sum(axis=1) <= 1 + 1e-6).all()
        # ... and the chosen experts' indices, the same tokens' in the same order: whole numbers naming the experts
        # the weights are nonzero for, the heaviest first.
        with ActivationLoader(spec.output, site="expert_indices", layers=layer, batch_size=8, shuffle=False) as loader:
            indices = np.asarray(next(loader))
        assert indices.shape == (8, 2) and (indices == np.round(indices)).all()
        chosen = indices.astype(int)
        assert (np.sort(chosen, axis=1) == np.sort(np.argsort(-batch, axis=1)[:, :2], axis=1)).all()
        weights = np.take_along_axis(batch, chosen, axis=1)
        assert (weights[:, 0] >= weights[:, 1]).all()
        assert hook_name(layer, layers, "expert_indices") == f"blocks.{layer}.mlp.hook_expert_indices"
        assert hook_name(layer, layers, "expert_weights") == f"blocks.{layer}.mlp.hook_expert_weights"
        assert hook_name(layer, layers, "router_logits") == f"blocks.{layer}.mlp.hook_router_logits"
