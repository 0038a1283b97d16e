"""Every family, every hook site of every layer and every hidden state, against transformers' own modules.

The reference is transformers' PyTorch model on the checkpoint it saved, with forward hooks on its modules
(tests/extract_model/families.py). Bounds are relative to transformers' own rounding (docs/MODEL.md, "Tolerances"),
because an absolute bound does not carry across shapes:

- float32: per output, our largest error against transformers' float64 forward (the same weights, widened) is at
  most FLOAT32_VS_TRANSFORMERS times transformers' own float32 error against it, plus one float32 rounding of the
  largest value.
- bfloat16: per output, against the same float64 forward, the mean over tokens of (1 - cosine) is at most
  BF16_MEAN_VS_TRANSFORMERS times that of transformers' bfloat16 forward, and the worst token's at most
  BF16_WORST_VS_TRANSFORMERS times transformers' worst (plus one bfloat16 rounding's worth). A mixture's values
  downstream of a token routed otherwise than float64 are left out, each such flip explained by a near-tie
  (tests/extract_model/routing.py states the rule).

The batch is right-padded (six samples of 9 to 30 tokens), so padding invariance is part of every comparison. The
small configs make each family's options matter (tests/extract_model/families.py: windows shorter than the samples,
scaled RoPE, a soft-cap below the logits). The real shapes (Llama-3.1-8B, Gemma-2-2B) run one and two layers at
their full width, marked `real_shape`.
"""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np
import pytest
import torch

from activations.format import HookPoint, Output, output_key, sites_of
from extract.engine import Engine
from tests.extract_model.families import FAMILIES, REAL_LENGTHS, FamilyModel, write_family_model, write_real_model
from tests.extract_model.routing import MIN_COMPARED, Flip, compared_tokens, routing_flips, unexplained

FLOAT32_VS_TRANSFORMERS = 4.0
BF16_MEAN_VS_TRANSFORMERS = 1.5
BF16_WORST_VS_TRANSFORMERS = 4.0
FLOAT32_ROUNDING = 2.0**-24
BF16_ROUNDING_COSINE = 2.0**-18  # 1 - cos of a vector whose every value is off by about one bfloat16 rounding
LENGTHS = [23, 9, 16, 30, 12, 20]


@dataclasses.dataclass
class References:
    samples: list[list[int]]
    batch: np.ndarray
    float32: list[dict[Output, np.ndarray]]
    float64: list[dict[Output, np.ndarray]]
    bfloat16: list[dict[Output, np.ndarray]]


def references(model: FamilyModel, lengths: list[int], seed: int = 0) -> References:
    rng = np.random.default_rng(seed)
    vocab = model.vocab_size
    samples = [rng.integers(1, vocab, n).tolist() for n in lengths]
    batch = np.zeros((len(samples), max(lengths)), np.int32)
    for row, sample in enumerate(samples):
        batch[row, : len(sample)] = sample
    return References(
        samples, batch,
        float32=[model.reference(s) for s in samples],
        float64=[model.reference(s, torch.float64) for s in samples],
        bfloat16=[model.reference(s, torch.bfloat16) for s in samples],
    )  # fmt: skip


def run_engine(model: FamilyModel, refs: References, dtype: str) -> dict[Output, np.ndarray]:
    outputs = model.every_output()
    engine = Engine(
        str(model.path), [o for o in outputs if isinstance(o, int)], sites=sites_of(outputs),
        batch_size=len(refs.samples), max_seq_len=refs.batch.shape[1], compute_dtype=dtype, out_dtype=dtype,
        devices=jax.devices()[:1],
    )  # fmt: skip
    got = engine.forward(refs.batch)
    assert list(got) == list(engine.outputs) == sorted(engine.outputs, key=outputs.index)
    assert not np.asarray(got.nonfinite).any()
    return {output: np.asarray(value, np.float64) for output, value in got.items()}


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def float32_errors(ours: dict, refs: References) -> dict[str, tuple[float, float, float]]:
    """Per output: (our max error, transformers' max error, max |value|), all against float64, over valid tokens."""
    errors = {}
    for output, values in ours.items():
        mine = theirs = scale = 0.0
        for row, sample in enumerate(refs.samples):
            wide = refs.float64[row][output]
            mine = max(mine, float(np.abs(values[row, : len(sample)] - wide).max()))
            theirs = max(theirs, float(np.abs(refs.float32[row][output] - wide).max()))
            scale = max(scale, float(np.abs(wide).max()))
        errors[output_key(output)] = (mine, theirs, scale)
    return errors


def bf16_errors(ours: dict, refs: References, compared: dict[Output, list[np.ndarray]] | None = None
                ) -> dict[str, tuple[float, float, float, float]]:
    """Per output: mean and worst (1 - cosine) over valid tokens against float64, ours then transformers'; only the
    tokens `compared` marks per sample, where given (`bf16_compared`). The chosen experts' indices are no direction
    to take a cosine of: they are held exactly (`assert_same_experts_chosen`, `routing.py`'s flips)."""
    errors = {}
    for output, values in ours.items():
        if isinstance(output, HookPoint) and output.site == "expert_indices":
            continue
        kept = compared[output] if compared else [np.ones(len(s), bool) for s in refs.samples]
        mine = np.concatenate([(1 - cosine(values[r, : len(s)], refs.float64[r][output]))[kept[r]]
                               for r, s in enumerate(refs.samples)])  # fmt: skip
        theirs = np.concatenate([(1 - cosine(refs.bfloat16[r][output], refs.float64[r][output]))[kept[r]]
                                 for r in range(len(refs.samples))])  # fmt: skip
        errors[output_key(output)] = (float(mine.mean()), float(theirs.mean()), float(mine.max()), float(theirs.max()))
    return errors


def bf16_flips(ours: dict, refs: References) -> list[Flip]:
    """The tokens a mixture's bfloat16 run, ours or transformers', routes otherwise than float64 (routing.py)."""
    per_sample = [{output: values[row, : len(s)] for output, values in ours.items()}
                  for row, s in enumerate(refs.samples)]  # fmt: skip
    return routing_flips(refs.float64, {"ours": per_sample, "transformers'": refs.bfloat16})


def bf16_compared(ours: dict, refs: References) -> dict[Output, list[np.ndarray]]:
    """Per output, per sample, the tokens the bfloat16 bounds compare: all but those downstream of a routing flip,
    each flip explained by a near-tie (routing.py states the rule; none in a dense model)."""
    flips = bf16_flips(ours, refs)
    assert not unexplained(flips), f"routed otherwise than float64 clear of a tie: {unexplained(flips)}"
    lengths = [len(s) for s in refs.samples]
    compared = {output: compared_tokens(output, lengths, flips) for output in ours}
    least = min(sum(map(np.sum, masks)) for masks in compared.values())
    assert least >= MIN_COMPARED * sum(lengths), f"only {least} of {sum(lengths)} tokens compared: {flips}"
    return compared


def assert_float32_within_bound(errors: dict) -> None:
    over = {key: e for key, e in errors.items() if e[0] > FLOAT32_VS_TRANSFORMERS * e[1] + FLOAT32_ROUNDING * e[2]}
    assert not over, f"(ours, transformers', scale) over the bound: {over}"


def assert_bf16_within_bound(errors: dict) -> None:
    over = {
        key: e for key, e in errors.items()
        if e[0] > BF16_MEAN_VS_TRANSFORMERS * e[1] + BF16_ROUNDING_COSINE
        or e[2] > BF16_WORST_VS_TRANSFORMERS * e[3] + BF16_ROUNDING_COSINE
    }  # fmt: skip
    assert not over, f"(mean ours, mean transformers', worst ours, worst transformers') over the bound: {over}"


def assert_same_experts_chosen(ours: dict, refs: References, model: FamilyModel, every_expert: bool = True) -> None:
    """A mixture's router chose the same experts as transformers' for every token of every layer (the nonzero
    entries of `expert_weights`; `expert_indices`, where kept, names the same ones in transformers' order, heaviest
    first), and, with `every_expert`, each layer routed some token to every expert."""
    layers = [output.layer for output in ours if isinstance(output, HookPoint) and output.site == "expert_weights"]
    for layer in layers:
        routed = set()
        for row, sample in enumerate(refs.samples):
            mine = ours[HookPoint("expert_weights", layer)][row, : len(sample)] != 0
            theirs = refs.float32[row][HookPoint("expert_weights", layer)] != 0
            np.testing.assert_array_equal(mine, theirs, err_msg=f"experts chosen in layer {layer}, sample {row}")
            indices = ours.get(HookPoint("expert_indices", layer))
            if indices is not None:
                indices = indices[row, : len(sample)]
                np.testing.assert_array_equal(indices, refs.float32[row][HookPoint("expert_indices", layer)],
                                              err_msg=f"expert indices in layer {layer}, sample {row}")  # fmt: skip
                named = np.zeros_like(mine)
                np.put_along_axis(named, indices.astype(int), True, axis=1)
                np.testing.assert_array_equal(named, mine, err_msg=f"indices and weights, layer {layer}, row {row}")
            routed |= set(np.flatnonzero(mine.any(axis=0)))
        assert not every_expert or routed == set(range(mine.shape[1])), f"layer {layer} never routed to some expert"
    assert layers or "expert_weights" not in model.layer_sites(0)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_site_and_hidden_state_matches_transformers_within_the_documented_bounds(model_type, tmp_path):
    model = write_family_model(tmp_path, model_type, seed=7)
    refs = references(model, LENGTHS)
    # The hooks see each site where transformers computes it: its residual identities hold in its own float64.
    for layer in range(model.num_hidden_layers):
        for values in refs.float64:
            site = {s: values[HookPoint(s, layer)] for s in model.layer_sites(layer) if s not in ("mlp_in", "mlp_hidden")}
            if "resid_mid" in site:
                np.testing.assert_allclose(site["resid_pre"] + site["attn_out"], site["resid_mid"], atol=1e-12)
                np.testing.assert_allclose(site["resid_mid"] + site["mlp_out"], site["resid_post"], atol=1e-12)
            else:  # in parallel (NeoX): both sublayers add to the layer's input
                np.testing.assert_allclose(site["resid_pre"] + site["attn_out"] + site["mlp_out"], site["resid_post"],
                                           atol=1e-12)  # fmt: skip
            np.testing.assert_array_equal(site["resid_pre"], values[layer])
    ours = run_engine(model, refs, "float32")
    errors = float32_errors(ours, refs)
    assert len(errors) == len(model.every_output())
    assert_float32_within_bound(errors)
    assert_same_experts_chosen(ours, refs, model)
    # The sites are really different tensors (not one value under several names).
    assert errors["resid_post_0"] == errors["layer_1"] and errors["attn_out_0"] != errors["mlp_out_0"]
    # In bfloat16 a mixture may route a token near a tie otherwise than float64; the bounds leave out what that
    # reaches, each such flip explained by a near-tie (tests/extract_model/routing.py; docs/MODEL.md).
    ours16 = run_engine(model, refs, "bfloat16")
    assert_bf16_within_bound(bf16_errors(ours16, refs, bf16_compared(ours16, refs)))


@pytest.mark.real_shape
@pytest.mark.parametrize("name", ["Llama-3.1-8B", "Gemma-2-2B"])
def test_real_shape_every_site_matches_transformers(name, tmp_path: pathlib.Path):
    """The other released widths (families.REAL) run in `bench/parity_table.py --real`; docs/MODEL.md has their
    tables."""
    model = write_real_model(tmp_path, name)
    refs = references(model, REAL_LENGTHS)
    assert_float32_within_bound(float32_errors(run_engine(model, refs, "float32"), refs))
    assert_bf16_within_bound(bf16_errors(run_engine(model, refs, "bfloat16"), refs))
