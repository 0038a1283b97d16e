"""What the families' structure implies beyond the numbers: sites a family lacks are refused by name, tensors are
found under every prefix their checkpoints use, positions past what the reference computes are refused, and the
memory model counts exactly the parameters transformers' model has."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from extract import memory as mem
from extract.config import ModelConfig
from extract.costmodel import job_outputs
from extract.engine import Engine
from extract.errors import BadInput
from extract.job import Job
from extract.weights import Checkpoint
from tests.extract_model.families import FAMILIES, respell, write_family_model


def engine(path, outputs=(0, -1), **overrides) -> Engine:
    args = dict(batch_size=2, max_seq_len=16, compute_dtype="float32", out_dtype="float32", devices=jax.devices()[:1])
    return Engine(str(path), list(outputs), **{**args, **overrides})


def test_a_site_the_family_does_not_have_is_refused_by_name_by_the_engine_and_the_planner(tmp_path):
    """NeoX's attention and MLP both read the layer's input: there is no resid_mid to return, and none is invented."""
    model = write_family_model(tmp_path, "gpt_neox")
    with pytest.raises(BadInput, match="'resid_mid' is not a hook site of gpt_neox"):
        engine(model.path, [], sites={"resid_mid": [0], "mlp_out": [1]})
    config = ModelConfig.from_file(model.path / "config.json")
    assert "resid_mid" not in config.sites and len(config.sites) == 6
    job = Job.from_dict({"model": str(model.path), "data_files": ["x.parquet"], "layers": [1],
                         "sites": {"resid_mid": [0]}, "max_seq_len": 16, "batch_size": 2, "shard_size": 8})  # fmt: skip
    with pytest.raises(BadInput, match="'resid_mid' is not a hook site of gpt_neox"):
        job_outputs(job, config)
    # The sequential NeoX layout has it.
    sequential = ModelConfig.from_dict({**config.to_dict(), "use_parallel_residual": False})
    assert "resid_mid" in sequential.sites


def test_multimodal_gemma3_loads_its_language_model_under_either_prefix(tmp_path):
    """As released (and as transformers 5 saves it), `language_model.model.*`; as some transformers 4 versions saved
    it, `model.language_model.*`. The vision tower's tensors are never read."""
    model = write_family_model(tmp_path / "released", "gemma3", shard_size=None)
    names = set(Checkpoint(model.path).tensors)
    assert "language_model.model.embed_tokens.weight" in names and any(n.startswith("vision_tower.") for n in names)
    batch = np.random.default_rng(0).integers(1, model.vocab_size, (2, 16)).astype(np.int32)
    released = {k: np.asarray(v) for k, v in engine(model.path, [0, 1, -1]).forward(batch).items()}
    respell(model.path, "language_model.model.", "model.language_model.")
    names = set(Checkpoint(model.path).tensors)
    assert "model.language_model.embed_tokens.weight" in names and "language_model.model.norm.weight" not in names
    newer = {k: np.asarray(v) for k, v in engine(model.path, [0, 1, -1]).forward(batch).items()}
    assert released.keys() == newer.keys()
    for key in released:
        np.testing.assert_array_equal(released[key], newer[key])


@pytest.mark.parametrize("model_type, limit", [("gpt2", 256), ("phi3", 32)])
def test_max_seq_len_past_what_the_reference_computes_is_refused_before_loading(model_type, limit, tmp_path):
    """GPT-2 has no position past its table; LongRoPE switches frequencies past its original context (here 32)."""
    model = write_family_model(tmp_path, model_type)
    assert ModelConfig.from_file(model.path / "config.json").max_positions == limit
    engine(model.path, max_seq_len=limit)
    with pytest.raises(BadInput, match=rf"max_seq_len={limit + 1} is longer .* use max_seq_len {limit} or less"):
        engine(model.path, max_seq_len=limit + 1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_weight_memory_is_every_parameter_of_transformers_decoder(family, tmp_path):
    """The memory model counts the weights of the model it builds (nnx.eval_shape); at full depth that is every
    parameter of transformers' decoder (its LM head and a multimodal model's vision tower aside), in every family's
    structure: norms before, around or after, LayerNorm biases, fused and plain MLPs, position tables."""
    model = write_family_model(tmp_path, family)
    config = ModelConfig.from_file(model.path / "config.json")
    decoder = sum(
        p.numel() for name, p in model.torch_model.named_parameters()
        if not any(part in name for part in ("lm_head", "vision_tower", "multi_modal_projector"))
    )  # fmt: skip
    assert mem.weight_bytes(config, config.num_hidden_layers, 2) == 2 * decoder
    # Split over a model axis of 2: the heads and the MLP width (all of them divide 2 here) halve.
    assert mem.weight_bytes(config, config.num_hidden_layers, 2, model_axis=2) < 2 * decoder * 0.75


def test_the_engine_hands_gemma2s_soft_cap_to_the_kernel_choice(tmp_path):
    """cuDNN through JAX cannot soft-cap logits, so on a GPU a Gemma 2 must get the oracle. The engine used to look
    the cap up under config.json's name on its ModelConfig, found none, and chose cuDNN, whose trace then failed.
    The device is a GPU's description (no GPU here); the decision is the engine's own."""
    from types import SimpleNamespace

    model = write_family_model(tmp_path, "gemma2")
    bf16 = engine(model.path, compute_dtype="bfloat16")
    h100 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3", compute_capability="9.0")
    assert bf16.config.attention_softcap == 3.0
    assert bf16._choose_attention(h100).kernel == "materialised"
    uncapped = ModelConfig.from_dict({**bf16.config.to_dict(), "attn_logit_softcapping": None})
    bf16.config = uncapped
    assert bf16._choose_attention(h100).kernel == "cudnn"
