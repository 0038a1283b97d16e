"""Inputs that retrying cannot fix are BadInput, and the message names the field or tensor at fault."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from extract.engine import Engine
from extract.errors import BadInput
from extract.weights import Checkpoint


def engine(path, layers=(1,), **overrides):
    kwargs = dict(batch_size=4, max_seq_len=16, compute_dtype="float32", devices=jax.devices()[:4])
    kwargs.update(overrides)
    return Engine(str(path), list(layers), **kwargs)


def copy_model(model, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(model.path, target)
    return target


def rewrite_single_file(path, drop=lambda name: False):
    """Merge every shard into one model.safetensors without the dropped tensors."""
    checkpoint = Checkpoint(path)
    tensors = {name: np.array(checkpoint.read(name)) for name in checkpoint.tensors if not drop(name)}
    for file in list(path.glob("*.safetensors")) + list(path.glob("*.index.json")):
        file.unlink()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_unknown_model_type_names_the_field_and_the_supported_ones(qwen2_untied, tmp_path):
    path = copy_model(qwen2_untied, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "deepseek_v3"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInput, match=r"model_type='deepseek_v3'.*latent attention.*gpt2 .*gpt_neox .*llama .*mistral .*qwen2 .*qwen3 .*phi3 .*olmo2 .*gemma .*gemma2 .*gemma3_text .*gemma3 "):
        engine(path)


def test_rope_scaling_not_implemented_is_refused_rather_than_silently_ignored(qwen2_untied, tmp_path):
    path = copy_model(qwen2_untied, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"type": "dynamic", "factor": 4.0}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadInput, match=r"rope_scaling\.rope_type='dynamic'"):
        engine(path)


def test_directory_without_safetensors_is_bad_input(qwen2_untied, tmp_path):
    path = copy_model(qwen2_untied, tmp_path)
    for file in list(path.glob("*.safetensors")) + list(path.glob("*.index.json")):
        file.unlink()
    with pytest.raises(BadInput, match=r"no \*\.safetensors"):
        engine(path)


def test_shard_named_by_the_index_but_absent_is_named(qwen2_untied, tmp_path):
    path = copy_model(qwen2_untied, tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(BadInput, match=shard.name):
        engine(path)


def test_missing_tensor_is_named(qwen2_untied, tmp_path):
    path = copy_model(qwen2_untied, tmp_path)
    missing = "model.layers.0.self_attn.k_proj.bias"
    rewrite_single_file(path, drop=lambda name: name == missing)
    with pytest.raises(BadInput, match=missing.replace(".", r"\.")):
        engine(path)


def test_weights_of_unused_layers_and_lm_head_are_never_read(qwen2_untied, tmp_path):
    """Hidden state 2 of 3 needs layers 0 and 1 only: a checkpoint without the rest still loads and computes."""
    path = copy_model(qwen2_untied, tmp_path)
    unused = ("model.layers.2.", "model.norm.", "lm_head.")
    rewrite_single_file(path, drop=lambda name: name.startswith(unused))
    partial = engine(path, layers=(0, 2))
    assert partial.num_computed_layers == 2
    tokens = np.arange(4 * 8, dtype=np.int32).reshape(4, 8)
    hidden = {k: np.asarray(v) for k, v in partial.forward(tokens).items()}
    full = engine(qwen2_untied.path, layers=(0, 2))
    for layer, array in full.forward(tokens).items():
        np.testing.assert_array_equal(hidden[layer], np.asarray(array))


def test_missing_model_directory_names_model(tmp_path):
    with pytest.raises(BadInput, match=r"model='\./nowhere'"):
        engine("./nowhere")


@pytest.mark.parametrize("layers", [[4], [-5], [], [1, "2"], [True]])
def test_layer_out_of_range_or_malformed_names_layers(qwen2_untied, layers):
    with pytest.raises(BadInput, match="layers"):
        engine(qwen2_untied.path, layers=layers)


@pytest.mark.parametrize("mesh", ["data=3,model=1", "data=2", "tensor=4", "data=two,model=2", "data=2,data=2", "data"])
def test_bad_mesh_string_names_mesh(qwen2_untied, mesh):
    with pytest.raises(BadInput, match="mesh="):
        engine(qwen2_untied.path, mesh=mesh)


def test_batch_size_that_does_not_split_over_data_axis_names_batch_size(qwen2_untied):
    with pytest.raises(BadInput, match="batch_size=2"):
        engine(qwen2_untied.path, batch_size=2, mesh="data=4,model=1")


@pytest.mark.parametrize("field", ["compute_dtype", "out_dtype"])
def test_unknown_dtype_names_the_field(qwen2_untied, field):
    with pytest.raises(BadInput, match=field):
        engine(qwen2_untied.path, **{field: "int8"})


def test_token_id_beyond_vocab_is_bad_input(qwen2_untied):
    e = engine(qwen2_untied.path)
    tokens = np.zeros((4, 8), np.int32)
    tokens[1, 3] = e.config.vocab_size
    with pytest.raises(BadInput, match="vocab_size"):
        e.forward(tokens)
