"""The weights the planner counts without JAX are the weights the engine builds.

`extract.memory.declared_shapes` reads every parameter's shape and sharding role from the config alone, so that
`gcs-spawner plan` sizes a job on the base install (no JAX). It is held here to `parameter_shapes`, the built
model's own (`nnx.eval_shape` of `extract.model.DecoderModel`), for every family, at every depth that builds a
different model: no layers, some, and the whole stack with its final norm.
"""

from __future__ import annotations

import collections

import pytest
from transformers import AutoConfig

from extract import memory as mem
from extract.config import ModelConfig
from tests.extract_model.families import FAMILIES, REAL, VOCAB


def _config(model_type: str, raw: dict) -> ModelConfig:
    return ModelConfig.from_dict(AutoConfig.for_model(model_type, **raw).to_dict(), source=model_type)


CONFIGS = {name: (name, raw) for name, raw in FAMILIES.items()}
# Released widths (heads that divide a model axis, biases, head_dim 256), at two layers and a small vocabulary
# (a multimodal one's text model is FAMILIES' gemma3).
CONFIGS.update({name: (model_type, dict(raw, num_hidden_layers=2, vocab_size=VOCAB))
                for name, (model_type, raw) in REAL.items() if "text_config" not in raw})  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_declared_shapes_are_the_built_models_parameters_at_every_depth(name):
    config = _config(*CONFIGS[name])
    for depth in sorted({0, 1, config.num_hidden_layers}):
        declared = collections.Counter(mem.declared_shapes(config, depth))
        built = collections.Counter(mem.parameter_shapes(config, depth))
        assert declared == built, (name, depth, declared - built, built - declared)
