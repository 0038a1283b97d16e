"""Sequence packing: several documents per row with a block-diagonal mask and per-document positions."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from extract.batching import TokenizedSample, make_batches, pack_window
from extract.engine import Engine
from tests.extract_model.conftest import VOCAB

#: The bound tests/extract_model/test_numerics.py documents for padding, the same kind of change (row layout only).
FLOAT32_ATOL = 1e-5
LENGTHS = [5, 17, 3, 9, 30, 1, 12, 7, 2, 20, 11, 6]


def per_sample(engine, batches):
    """{position: {layer: [n, hidden] float32}} from the engine's outputs for `batches`."""
    out = {}
    for batch in batches:
        if batch.segment_ids is not None:
            hidden = engine.forward(batch.token_ids, batch.segment_ids, batch.positions)
        else:
            hidden = engine.forward(batch.token_ids)
        placements = batch.placements or [(r, 0) for r in range(len(batch.samples))]
        for sample, (row, column) in zip(batch.samples, placements):
            n = sample.n_tokens
            out[sample.position] = {k: np.asarray(v)[row, column : column + n] for k, v in hidden.items()}
    return out


@pytest.mark.parametrize("fixture", ["qwen2_untied", "qwen3"])
def test_packed_rows_give_each_document_its_unpacked_hidden_states_in_float32(fixture, request):
    model = request.getfixturevalue(fixture)
    engine = Engine(
        str(model.path), [1, -1], batch_size=2, max_seq_len=32, compute_dtype="float32", out_dtype="float32",
        devices=jax.devices()[:1],
    )  # fmt: skip
    rng = np.random.default_rng(5)
    window = [TokenizedSample(p, p, rng.integers(1, VOCAB, n).astype(np.int32)) for p, n in enumerate(LENGTHS)]
    buckets = (8, 16, 32)
    packed_batches = pack_window(window, 2, buckets, pad_id=0)
    plain_batches = make_batches(window, 2, buckets, pad_id=0)
    assert sum(b.token_ids.size for b in packed_batches) < sum(b.token_ids.size for b in plain_batches)
    assert any(len(set(r for r, _ in b.placements)) < len(b.samples) for b in packed_batches), "rows hold several"
    packed, plain = per_sample(engine, packed_batches), per_sample(engine, plain_batches)
    assert sorted(packed) == sorted(plain) == list(range(len(LENGTHS)))
    for position in plain:
        for layer in engine.layers:
            np.testing.assert_allclose(packed[position][layer], plain[position][layer], atol=FLOAT32_ATOL, rtol=0)


def test_packing_is_deterministic_and_keeps_every_token_once():
    rng = np.random.default_rng(1)
    window = [TokenizedSample(p, 100 + p, rng.integers(1, 50, n).astype(np.int32)) for p, n in enumerate(LENGTHS)]
    window.append(TokenizedSample(len(LENGTHS), 999, np.zeros(0, np.int32)))
    first, second = pack_window(window, 2, (8, 16, 32), 0), pack_window(window, 2, (8, 16, 32), 0)
    assert [b.placements for b in first] == [b.placements for b in second]
    assert [s.sample_id for b in first for s in b.empty] == [999]
    for batch in first:
        for sample, (row, column) in zip(batch.samples, batch.placements):
            n = sample.n_tokens
            assert np.array_equal(batch.token_ids[row, column : column + n], sample.token_ids)
            assert np.array_equal(batch.positions[row, column : column + n], np.arange(n))
            assert len(set(batch.segment_ids[row, column : column + n])) == 1
        assert (batch.segment_ids > 0).sum() == sum(s.n_tokens for s in batch.samples)
