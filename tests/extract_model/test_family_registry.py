"""Every family is one complete registry entry (`extract.families.FAMILIES`): its reader reads its small config, its
tensor names cover every parameter of the model built from it (no two parameters in one place), its hook sites are
exactly what its layers return, and its planning figure is the MLP weights a token multiplies with, counted from the
built model.

Adding a family means adding its entry and its small config (tests/extract_model/families.py), and this test holds
both to that; transformers' config class defaults of each entry are checked in test_families.py."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from activations.format import HookPoint
from extract import names
from extract.config import ModelConfig
from extract.families import FAMILIES
from extract.model import DecoderModel
from tests.extract_model.families import FAMILIES as SMALL_CONFIGS
from tests.extract_model.test_families import CONFIG_CLASSES


def test_every_registered_family_has_a_small_config_and_a_config_class_and_nothing_else_does():
    assert set(SMALL_CONFIGS) == set(FAMILIES) == set(CONFIG_CLASSES)


def small_config(model_type: str) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": model_type, **SMALL_CONFIGS[model_type]})


def built(config: ModelConfig) -> DecoderModel:
    return DecoderModel(config, config.num_hidden_layers, jnp.float32, nnx.Rngs(0))


def parameters(model: DecoderModel) -> dict[tuple, tuple[int, ...]]:
    return {tuple(path): tuple(v.get_value().shape) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_entry_names_a_distinct_checkpoint_tensor_for_every_parameter(model_type):
    config = small_config(model_type)
    assert config.family is FAMILIES[model_type] and config.family.name
    places = {}
    prefix = config.family.names.prefixes[0]
    for path in parameters(nnx.eval_shape(lambda: built(config))):
        stored = names.tensor_for(config, path, prefix)  # a KeyError names a parameter the entry does not cover
        place = (stored.name, stored.ranges)
        assert place not in places, f"{path} and {places[place]} are both read from {place}"
        places[place] = path


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_the_entry_hook_sites_are_what_its_layers_return_and_its_planning_figure_is_the_active_mlp(model_type):
    config = small_config(model_type)
    model = built(config)
    every_site = [HookPoint(site, layer) for layer in range(config.num_hidden_layers) for site in config.layer_sites(layer)]
    got = model(jnp.ones((1, 4), jnp.int32), every_site)
    assert set(got) == set(every_site)
    assert all(np.isfinite(np.asarray(value)).all() for value in got.values())
    for layer in range(config.num_hidden_layers):
        mlp = parameters(model.layers[layer].mlp)
        matrices = sum(math.prod(shape) for shape in mlp.values() if len(shape) == 2)
        experts = sum(math.prod(shape) for shape in mlp.values() if len(shape) == 3)  # a mixture's [E, in, out]
        moe = config.moe_layer(layer)
        assert (moe is None) == (experts == 0)
        active = matrices + (experts // moe.num_experts * moe.top_k if moe else 0)  # only the chosen experts
        assert config.family.mlp_weights(config, layer) == active, (layer, mlp)
