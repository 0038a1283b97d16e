"""Tokenisation into fixed-shape batches: few shapes, every sample once, nothing beyond max_seq_len."""

from __future__ import annotations

import numpy as np
import pytest

from extract.batching import (
    Prefetcher,
    TokenizedSample,
    Tokenizer,
    batches_for_slice,
    bucket_for,
    make_batches,
    window_bounds,
)
from extract.data import Document, read_slice
from extract.job import Task


def test_windows_never_straddle_a_shard_boundary():
    bounds = list(window_bounds(5, 70, window=32, shard_size=24))
    assert bounds == [(5, 24), (24, 32), (32, 48), (48, 64), (64, 70)]
    # A run resumed at a shard boundary cuts the rest of the slice exactly as an uninterrupted run does.
    assert list(window_bounds(48, 70, window=32, shard_size=24)) == [b for b in bounds if b[0] >= 48]


def test_bucket_is_the_smallest_that_fits():
    buckets = (64, 128, 256)
    assert [bucket_for(n, buckets) for n in (1, 64, 65, 256)] == [64, 64, 128, 256]
    with pytest.raises(ValueError):
        bucket_for(257, buckets)


def sample(position: int, n_tokens: int) -> TokenizedSample:
    return TokenizedSample(position, 1000 + position, np.arange(1, n_tokens + 1, dtype=np.int32))


def test_batches_have_fixed_rows_and_padding_on_the_right():
    window = [sample(p, n) for p, n in enumerate([3, 0, 70, 5, 5, 0, 12])]
    batches = make_batches(window, batch_size=4, buckets=(8, 16, 128), pad_id=0)
    assert [b.token_ids.shape for b in batches] == [(4, 128), (4, 8)]
    assert [[s.position for s in b.samples] for b in batches] == [[2, 6, 3, 4], [0]]  # longest first
    assert [s.position for s in batches[0].empty] == [1, 5] and batches[1].empty == ()
    last = batches[1].token_ids
    assert list(last[0]) == [1, 2, 3, 0, 0, 0, 0, 0] and not last[1:].any()  # padded with empty rows


def test_a_window_of_empty_texts_needs_no_device_batch():
    (batch,) = make_batches([sample(0, 0), sample(1, 0)], batch_size=4, buckets=(8,), pad_id=0)
    assert batch.token_ids is None and batch.samples == () and len(batch.empty) == 2


def test_slice_becomes_batches_of_few_shapes_holding_each_sample_once(tiny_models, corpus):
    tokenizer = Tokenizer(tiny_models["qwen2"], max_seq_len=128)
    task = Task.from_dict({"id": "t", "files": corpus.slice_files([(0, 3, 40), (1, 0, 30)])})
    texts = {d.position: d.text for d in read_slice(task, "text")}
    batches = list(
        batches_for_slice(read_slice(task, "text"), tokenizer, start=0, end=task.num_samples, batch_size=4,
                          shard_size=16, buckets=(32, 64, 128))  # fmt: skip
    )
    shapes = {b.token_ids.shape for b in batches if b.token_ids is not None}
    assert shapes <= {(4, 32), (4, 64), (4, 128)}
    seen = [s.position for b in batches for s in (*b.samples, *b.empty)]
    assert sorted(seen) == list(range(task.num_samples))
    lengths = {s.position: s.n_tokens for b in batches for s in (*b.samples, *b.empty)}
    assert max(lengths.values()) == 128, "the corpus has over-long documents, truncated to max_seq_len"
    assert any(n == 0 for n in lengths.values()), "the corpus has empty texts, kept with zero tokens"
    for b in batches:
        for row, s in enumerate(b.samples):
            expected = tokenizer.hf(texts[s.position], add_special_tokens=False)["input_ids"][:128]
            assert list(s.token_ids) == expected
            assert list(b.token_ids[row, : s.n_tokens]) == expected
    assert all(len(b.samples) <= 4 for b in batches)


def test_special_token_text_is_encoded_as_plain_text(tiny_models):
    tokenizer = Tokenizer(tiny_models["qwen2"], max_seq_len=64)
    (ids,) = tokenizer.encode(["end <|endoftext|>"])
    assert tokenizer.hf.eos_token_id not in ids.tolist()
    assert tokenizer.hf.decode(ids) == "end <|endoftext|>"


def test_prefetcher_reraises_the_producer_error_in_the_consumer():
    def produce():
        yield Document(0, 0, "a")
        raise KeyError("boom in the producer thread")

    items = []
    with pytest.raises(KeyError, match="boom"):
        for item in Prefetcher(produce(), depth=1):
            items.append(item)
    assert items == [Document(0, 0, "a")]
