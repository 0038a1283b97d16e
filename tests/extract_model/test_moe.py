"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) beyond the parity every family passes
(test_family_parity.py, which also checks that the same experts are chosen for every token): the variants the small
configs leave out, the tie-breaking rule, the router's sites by layer, and a 4-device mesh split by experts and by
expert width."""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from activations.format import HookPoint
from bench.moe_memory import QWEN3_30B_A3B
from extract.config import ModelConfig
from extract.engine import Engine
from extract.errors import BadInput
from tests.extract_model.test_family_parity import (
    LENGTHS,
    assert_float32_within_bound,
    assert_same_experts_chosen,
    float32_errors,
    references,
    run_engine,
)
from tests.extract_model.families import write_family_model

#: What the small configs do not cover: Qwen2-MoE renormalising, with every other layer dense by
#: decoder_sparse_step; Qwen3-MoE not renormalising, with a dense layer by mlp_only_layers.
VARIANTS = {
    "qwen2_moe-sparse-step-2-renormalised": ("qwen2_moe", dict(decoder_sparse_step=2, mlp_only_layers=[],
                                                               norm_topk_prob=True)),
    "qwen3_moe-not-renormalised-dense-layer-0": ("qwen3_moe", dict(norm_topk_prob=False, mlp_only_layers=[0])),
}  # fmt: skip


@pytest.mark.parametrize("case", list(VARIANTS))
def test_moe_variants_match_transformers_and_choose_the_same_experts(case, tmp_path):
    model_type, overrides = VARIANTS[case]
    model = write_family_model(tmp_path, model_type, seed=11, **overrides)
    config = ModelConfig.from_file(model.path / "config.json")
    sparse = [i for i in range(config.num_hidden_layers) if config.moe_layer(i)]
    assert sparse == {"qwen2_moe": [1], "qwen3_moe": [1, 2]}[model_type]
    refs = references(model, LENGTHS[:3])
    ours = run_engine(model, refs, "float32")
    assert_float32_within_bound(float32_errors(ours, refs))
    assert_same_experts_chosen(ours, refs, model)


def test_equal_router_probabilities_go_to_the_higher_expert_index_as_in_transformers(tmp_path):
    """Experts 0, 1 and 2 of every layer get one router row (so equal logits, bit for bit), expert 3 another: two of
    the three tied experts are chosen where expert 3 loses, one where it wins; both times the highest indices, as
    torch.topk on CPU chooses (experts.py states the rule)."""
    model = write_family_model(tmp_path, "qwen3_moe", seed=5, shard_size=None)
    path = model.path / "model.safetensors"
    tensors = load_file(str(path))
    for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
        router = tensors[name]
        router[1] = router[2] = router[0]
        tensors[name] = router
    save_file(tensors, str(path), metadata={"format": "pt"})
    rewritten = type(model)(model.path, _reloaded(model.path), model.num_hidden_layers)
    refs = references(rewritten, LENGTHS[:3])
    ours = run_engine(rewritten, refs, "float32")
    assert_same_experts_chosen(ours, refs, rewritten, every_expert=False)
    outcomes = set()
    for layer in range(rewritten.num_hidden_layers):
        weights = ours[HookPoint("expert_weights", layer)]
        for row, sample in enumerate(refs.samples):
            for chosen in weights[row, : len(sample)] != 0:
                outcomes.add(tuple(np.flatnonzero(chosen)))
    # The tied experts are chosen highest first: never 0 or 1 without 2, never 0 without 1.
    assert outcomes == {(1, 2), (2, 3)}, outcomes


def _reloaded(path: pathlib.Path):
    """transformers' model of a rewritten checkpoint, float32 and eager (as families.write_family_model builds it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return AutoModelForCausalLM.from_pretrained(path, config=config).eval()


def test_router_sites_exist_only_on_mixture_layers_and_mlp_hidden_only_on_dense_ones(tmp_path):
    model = write_family_model(tmp_path, "qwen2_moe")  # layer 1 is dense (mlp_only_layers)
    config = ModelConfig.from_file(model.path / "config.json")
    assert config.layer_sites(0)[-3:] == ("router_logits", "expert_weights", "expert_indices")
    assert "mlp_hidden" not in config.layer_sites(0)
    assert "mlp_hidden" in config.layer_sites(1) and "router_logits" not in config.layer_sites(1)
    with pytest.raises(BadInput, match=r"sites.router_logits: layer 1 has no router_logits: its MLP is dense"):
        config.hook_points({"router_logits": [0, 1]})
    with pytest.raises(BadInput, match=r"sites.mlp_hidden: layer 2 has no mlp_hidden: its MLP is a mixture"):
        config.hook_points({"mlp_hidden": [1, 2]})
    assert config.width(HookPoint("router_logits", 0)) == config.width(HookPoint("expert_weights", 2)) == 4
    assert config.width(HookPoint("expert_indices", 0)) == 2  # num_experts_per_tok
    with pytest.raises(BadInput, match=r"sites.expert_indices: layer 1 has no expert_indices: its MLP is dense"):
        config.hook_points({"expert_indices": [1]})


@pytest.mark.parametrize("experts, mesh", [(4, "data=1,model=4"), (6, "data=2,model=2"), (3, "data=1,model=4")])
def test_a_four_device_mesh_split_by_experts_or_by_their_width_matches_one_device(experts, mesh, tmp_path):
    """4 experts over model=4 and 6 over model=2 split by expert; 3 experts do not divide 4, so each expert's width
    (48) splits instead."""
    devices = jax.devices()
    assert len(devices) >= 4, "needs XLA_FLAGS=--xla_force_host_platform_device_count=4 before jax is imported"
    model = write_family_model(tmp_path, "qwen3_moe", seed=3, num_experts=experts)
    sites = {"mlp_out": [0, 2], "router_logits": [1], "expert_weights": [2], "expert_indices": [1, 2]}

    def outputs(devices, mesh=None):
        engine = Engine(str(model.path), [1, -1], sites=sites, batch_size=4, max_seq_len=24, compute_dtype="float32",
                        out_dtype="float32", devices=devices, mesh=mesh)  # fmt: skip
        batch = np.random.default_rng(0).integers(1, model.vocab_size, (4, 24)).astype(np.int32)
        return engine, {k: np.asarray(v) for k, v in engine.forward(batch).items()}

    _, single = outputs(devices[:1])
    engine, split = outputs(devices[:4], mesh)
    expert_gate = engine._state["layers"][0]["mlp"]["experts"]["gate_proj"][...]
    by_expert = experts % dict(engine.mesh.shape)["model"] == 0
    assert tuple(expert_gate.sharding.spec) == (("model", None, None) if by_expert else (None, None, "model"))
    for key, value in single.items():
        np.testing.assert_allclose(split[key], value, atol=2e-5, rtol=0, err_msg=str(key))


def test_transformers_5_saves_the_released_layout_one_tensor_per_expert(tmp_path):
    """Its conversion mapping merges the experts at load and splits them again at save, so a checkpoint saved by
    transformers 5 is in the released layout: the names read here are the names it writes."""
    model = write_family_model(tmp_path, "mixtral", shard_size=None)
    names = set(load_file(str(model.path / "model.safetensors")))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any("gate_up_proj" in name for name in names)
    assert json.loads((model.path / "config.json").read_text())["model_type"] == "mixtral"


def test_the_memory_model_counts_every_expert_and_shards_qwen3_30b_a3b_where_one_chip_is_too_small():
    """Every expert's weights count for memory (30.2 billion parameters without the LM head: more than a 32 GiB v4
    chip or a 16 GiB v5e chip holds in bfloat16), only the chosen experts for FLOPs; the automatic mesh then splits
    the experts over a v4-8's four chips and a v5litepod-8's eight."""
    from extract import costmodel, memory

    config = ModelConfig.from_dict(QWEN3_30B_A3B)
    layers = config.num_hidden_layers
    d, e, f = 2048, 128, 768
    attention = d * 32 * 128 * 2 + d * 4 * 128 * 2 + 2 * 128 + 2 * d  # q, o; k, v; q/k norms; two layer norms
    per_layer = attention + d * e + e * 3 * d * f
    assert memory.weight_bytes(config, layers, 2) == 2 * (layers * per_layer + 151936 * d + d)
    # Split by expert over 4 chips: every expert tensor is a quarter; attention splits by heads (32 and 4 divide 4).
    experts = layers * e * 3 * d * f
    assert memory.weight_bytes(config, layers, 2, model_axis=4) == 2 * (
        layers * (attention - 2 * 128 - 2 * d) // 4 + layers * (2 * 128 + 2 * d + d * e) + experts // 4
        + 151936 * d // 4 + d)  # fmt: skip
    # FLOPs: the router and 8 of the 128 experts a token.
    assert config.family.mlp_weights(config, 0) == d * e + 8 * 3 * d * f
    assert costmodel.projection_flops_per_token(config) == 2 * (d * 32 * 128 * 2 + d * 4 * 128 * 2 + d * e + 8 * 3 * d * f)
    step = dict(num_layers=layers, batch_size=8, seq_len=1024, compute_bytes=2, out_bytes=2, num_outputs=1)
    for accelerator, chips, shape in (("v4", 4, (1, 4)), ("v5e", 8, (1, 8))):
        usable = memory.usable_bytes(accelerator, "tpu")
        assert memory.replica_bytes(config, layers, 8, 1024, 2, 2, 1) > usable  # one chip: too small
        assert memory.choose_mesh_shape(config, chips, usable, **step) == shape, accelerator


def test_expert_indices_are_refused_where_the_output_dtype_cannot_hold_every_index_exactly(tmp_path):
    """bfloat16 holds whole numbers exactly only up to 256: a model of 257 experts keeps its indices in float32, or
    its weights; the same site in float16 (exact to 2,048) is accepted."""
    model = write_family_model(tmp_path, "olmoe", seed=1, num_hidden_layers=1, num_experts=257, intermediate_size=8,
                               shard_size=None)  # fmt: skip

    def engine(sites, out_dtype):
        return Engine(str(model.path), [], sites=sites, batch_size=1, max_seq_len=8, compute_dtype="float32",
                      out_dtype=out_dtype, devices=jax.devices()[:1])  # fmt: skip

    with pytest.raises(BadInput, match=r"^sites.expert_indices: out_dtype bfloat16 holds whole numbers exactly only "
                                       r"up to 256, and this model has 257 experts; use float32"):  # fmt: skip
        engine({"expert_indices": [0]}, "bfloat16")
    engine({"expert_weights": [0]}, "bfloat16")
    got = engine({"expert_indices": [0]}, "float16").forward(np.arange(1, 9, dtype=np.int32)[None])
    indices = np.asarray(got[HookPoint("expert_indices", 0)], np.float64)
    assert indices.shape == (1, 8, 2) and (indices == np.round(indices)).all() and (0 <= indices).all()
    assert (indices < 257).all()


#: How transformers' routers (5.24, `MixtralTopKRouter`, `OlmoeTopKRouter`, `Qwen3MoeTopKRouter`) turn their logits
#: into weights: renormalised or not, and kept in float32 (Mixtral) or cast back to the logits' dtype (Qwen3-MoE's
#: router is OLMoE's with the renormalisation).
ROUTERS = {"mixtral": (True, True), "olmoe": (False, False)}


@pytest.mark.parametrize("model_type", list(ROUTERS))
def test_a_bf16_router_takes_the_softmax_of_its_bf16_logits_in_float32_as_transformers_does(model_type, tmp_path):
    """Given the router's own bfloat16 logits (the `router_logits` site, exact in a float32 output), its weights are
    what transformers' router code computes from them: a float32 softmax, torch.topk, the renormalisation, then
    Mixtral keeps them in float32 and the others round them to bfloat16. The parity bounds cannot see a softmax
    taken in bfloat16 (it moves a weight by a bfloat16 rounding, as bfloat16's own noise does); this sees it:
    Mixtral's float32 weights would be 2^-9 off instead of 2^-23, and the others' roundings would differ."""
    import torch

    renormalise, keeps_float32 = ROUTERS[model_type]
    model = write_family_model(tmp_path, model_type, seed=7, shard_size=None)
    layers = [0, 1, 2]
    engine = Engine(
        str(model.path), [], sites={"router_logits": layers, "expert_weights": layers}, batch_size=4, max_seq_len=24,
        compute_dtype="bfloat16", out_dtype="float32", devices=jax.devices()[:1],
    )  # fmt: skip
    batch = np.random.default_rng(1).integers(1, model.vocab_size, (4, 24)).astype(np.int32)
    got = {key: np.asarray(value) for key, value in engine.forward(batch).items()}
    top_k = model.torch_model.config.num_experts_per_tok
    identical = total = 0
    for layer in layers:
        returned = got[HookPoint("router_logits", layer)]
        returned = returned.reshape(-1, returned.shape[-1])
        logits = torch.tensor(returned).to(torch.bfloat16)
        assert (logits.float().numpy() == returned).all()  # bfloat16 values, exact in float32
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, chosen = torch.topk(probs, top_k, dim=-1)
        if renormalise:
            top /= top.sum(dim=-1, keepdim=True)
        if not keeps_float32:
            top = top.to(torch.bfloat16)
        expected = torch.zeros_like(probs).scatter(1, chosen, top.float()).numpy()
        ours = got[HookPoint("expert_weights", layer)].reshape(expected.shape)
        np.testing.assert_array_equal(ours != 0, expected != 0, err_msg=f"experts chosen in layer {layer}")
        if keeps_float32:  # a few float32 roundings of values at most 1
            np.testing.assert_allclose(ours, expected, rtol=0, atol=2.0**-21, err_msg=f"layer {layer}")
        else:  # within one bfloat16 rounding, and identical but where float32 lands on a rounding boundary
            np.testing.assert_allclose(ours, expected, rtol=2.0**-8, atol=0, err_msg=f"layer {layer}")
            identical += int((ours[expected != 0] == expected[expected != 0]).sum())
            total += int((expected != 0).sum())
    assert keeps_float32 or identical >= 0.98 * total, f"{identical} of {total} bfloat16 weights identical"
