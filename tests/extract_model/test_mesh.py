"""A real 4-device CPU mesh in every (data, model) layout gives the single-device hidden states."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from extract.config import ModelConfig
from extract.engine import Engine
from extract.memory import choose_mesh_shape, replica_bytes
from extract.sharding import ShardingRules, parse_mesh
from tests.extract_model.conftest import ragged_batch

LAYERS = [0, 2, -1]
BATCH = 4


@pytest.fixture(scope="module")
def four_devices():
    devices = jax.devices()
    assert len(devices) >= 4, (
        f"the mesh tests need 4 devices, found {len(devices)}: XLA_FLAGS="
        "--xla_force_host_platform_device_count=4 must be set before jax is imported"
    )
    return devices[:4]


@pytest.fixture(scope="module")
def tokens():
    batch, _ = ragged_batch(np.random.default_rng(7), [19, 4, 12, 16])
    return batch


@pytest.fixture(scope="module")
def single_device_hidden(qwen2_untied, tokens, four_devices):
    engine = Engine(
        str(qwen2_untied.path), LAYERS, batch_size=BATCH, max_seq_len=32, compute_dtype="float32",
        out_dtype="float32", devices=four_devices[:1],
    )  # fmt: skip
    return {layer: np.asarray(h) for layer, h in engine.forward(tokens).items()}


@pytest.mark.parametrize("mesh", ["data=1,model=4", "data=2,model=2", "data=4,model=1"])
def test_mesh_layout_matches_single_device(mesh, qwen2_untied, tokens, four_devices, single_device_hidden):
    engine = Engine(
        str(qwen2_untied.path), LAYERS, batch_size=BATCH, max_seq_len=32, compute_dtype="float32",
        out_dtype="float32", mesh=mesh, devices=four_devices,
    )  # fmt: skip
    data, model = (int(part.split("=")[1]) for part in mesh.split(","))
    assert dict(engine.mesh.shape) == {"data": data, "model": model}
    hidden = engine.forward(tokens)
    for layer, array in hidden.items():
        # Outputs are split over the batch ("data") and whole on every model shard.
        assert array.sharding.spec == P("data", None, None)
        assert len(array.sharding.device_set) == 4
        np.testing.assert_allclose(np.asarray(array), single_device_hidden[layer], atol=1e-5, rtol=0)


def test_tensor_parallel_splits_heads_and_mlp_but_replicates_too_few_kv_heads(qwen2_untied):
    config = ModelConfig.from_file(qwen2_untied.path / "config.json")
    four = ShardingRules.for_config(config, 4)  # 4 query heads, 2 kv heads
    assert four.q_proj == P(None, "model", None) and four.o_proj == P("model", None, None)
    assert four.kv_proj == P(None, None, None), "2 kv heads cannot split over 4 devices"
    assert four.mlp_in == P(None, "model") and four.mlp_out == P("model", None)
    two = ShardingRules.for_config(config, 2)
    assert two.kv_proj == P(None, "model", None)


def test_automatic_mesh_on_cpu_is_pure_data_parallel(qwen2_untied, four_devices):
    engine = Engine(
        str(qwen2_untied.path), [1], batch_size=8, max_seq_len=16, compute_dtype="float32", devices=four_devices
    )
    assert dict(engine.mesh.shape) == {"data": 4, "model": 1}


def test_automatic_mesh_moves_devices_to_model_when_batch_does_not_split(qwen2_untied, four_devices):
    engine = Engine(
        str(qwen2_untied.path), [1], batch_size=2, max_seq_len=16, compute_dtype="float32", devices=four_devices
    )
    assert dict(engine.mesh.shape) == {"data": 2, "model": 2}


QWEN25_7B = {
    "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
}  # fmt: skip
GIB = 1024**3


def choose(device_memory, device_count=4, batch_size=16, seq_len=512):
    config = ModelConfig.from_dict(QWEN25_7B)
    return choose_mesh_shape(
        config, device_count, device_memory, num_layers=config.num_hidden_layers, batch_size=batch_size,
        seq_len=seq_len, compute_bytes=2, out_bytes=2, num_outputs=1,
    )  # fmt: skip


def test_seven_billion_replica_fits_a_large_device_so_pure_data_parallel():
    assert choose(80 * GIB) == (4, 1)
    assert choose(None) == (4, 1)  # memory unknown (CPU): ample


def test_seven_billion_on_small_devices_uses_the_smallest_model_axis_that_fits():
    c = ModelConfig.from_dict(QWEN25_7B)
    d, f, h = c.hidden_size, c.intermediate_size, c.head_dim
    per_layer = d * c.num_attention_heads * h * 2 + 2 * d * c.num_key_value_heads * h + 3 * d * f
    weight_bytes = 2 * (c.vocab_size * d + c.num_hidden_layers * per_layer)  # bf16, no LM head
    one_replica = replica_bytes(c, c.num_hidden_layers, 4, 512, 2, 2, 1)
    assert weight_bytes < one_replica < 1.2 * weight_bytes  # weights plus one micro-batch of activations
    assert one_replica > 0.8 * 16 * GIB  # so a 16 GiB device cannot hold a replica...
    assert choose(16 * GIB) == (2, 2)  # ...but half of one (heads, kv heads and MLP split in two) fits
    assert choose(8 * GIB) == (1, 4)
    assert choose(1 * GIB) == (1, 4)  # nothing fits: maximal tensor parallelism, XLA reports the OOM if any


def test_explicit_mesh_must_span_every_device():
    assert parse_mesh("model=2,data=2", 4) == (2, 2)
    assert parse_mesh("data=4", 4) == (4, 1)
