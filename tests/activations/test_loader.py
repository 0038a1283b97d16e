"""The streaming loader against shards the real writer wrote: every token once per epoch, filters, ranks, exact
resume, normalisation from the stored statistics, gs:// through the real client, and no JAX needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from activations.format import LayerStats
from activations.loader import ActivationLoader, LoaderConfigError
from activations.reader import open_activations
from tests.activations.conftest import HIDDEN, LAYERS, Written
from tests.workers import REPO


def keys_of(loader) -> list[np.ndarray]:
    return [Written.row_key(batch) for batch in loader]


def test_unshuffled_stream_is_every_token_in_shard_order(written):
    batches = keys_of(ActivationLoader(str(written.root), layers=1, batch_size=7, shuffle=False))
    n = len(written.token_ids)
    assert [len(b) for b in batches] == [7] * (n // 7) + ([n % 7] if n % 7 else [])
    assert np.array_equal(np.concatenate(batches), np.arange(n))


def test_shuffled_epoch_reads_every_token_exactly_once_and_mixes_across_shards(written):
    loader = ActivationLoader(str(written.root), layers=3, batch_size=8, shuffle_tokens=64, seed=3)
    batches = keys_of(loader)
    stream = np.concatenate(batches)
    assert sorted(stream.tolist()) == list(range(len(written.token_ids)))
    assert all(len(b) == 8 for b in batches[:-1])
    # Mixed: the first batch draws from far apart in the job (shards are permuted, then the buffer mixes).
    assert np.ptp(batches[0]) > 40 and not np.array_equal(stream, np.sort(stream))
    second = np.concatenate(keys_of(ActivationLoader(str(written.root), layers=3, batch_size=8, shuffle_tokens=64, seed=4)))
    assert not np.array_equal(stream, second)


def test_two_epochs_each_cover_every_token_in_a_different_order(written):
    stream = np.concatenate(keys_of(ActivationLoader(str(written.root), layers=1, batch_size=5, shuffle_tokens=32, epochs=2, drop_last=False)))
    n = len(written.token_ids)
    assert len(stream) == 2 * n
    first, second = stream[:n], stream[n:]
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(n))
    assert not np.array_equal(first, second)


def test_ranks_split_every_token_to_exactly_one_rank(written):
    per_rank = [
        np.concatenate(keys_of(ActivationLoader(str(written.root), layers=1, batch_size=4, shuffle_tokens=16, rank=r, world_size=3)))
        for r in range(3)
    ]
    union = np.concatenate(per_rank)
    assert sorted(union.tolist()) == list(range(len(written.token_ids)))
    shards = len(written.records)
    assert max(map(len, per_rank)) - min(map(len, per_rank)) <= shards


def test_token_filters_keep_exactly_the_tokens_numpy_selects(written):
    loader = ActivationLoader(str(written.root), layers=1, batch_size=6, shuffle_tokens=20,
                              drop_token_ids=[0, 1, 2, 3, 4], drop_first=1, positions=(0, 8))  # fmt: skip
    got = np.sort(np.concatenate(keys_of(loader)))
    keep = ~np.isin(written.token_ids, [0, 1, 2, 3, 4]) & (written.positions >= 1) & (written.positions < 8)
    assert np.array_equal(got, np.flatnonzero(keep)) and 0 < len(got) < len(written.token_ids)


def test_several_layers_give_one_row_per_token_across_layers(written):
    loader = ActivationLoader(str(written.root), layers=list(LAYERS), batch_size=8, shuffle_tokens=32, return_token_ids=True)
    batch, tokens = next(loader)
    assert batch.shape == (8, 2, HIDDEN) and batch.dtype == np.float32
    keys = Written.row_key(batch[:, 0])
    assert np.array_equal(keys, Written.row_key(batch[:, 1]))
    assert np.array_equal(tokens, written.token_ids[keys])
    assert np.array_equal(batch[:, 1], np.asarray(written.layers[3][keys], np.float32))


# Early in the stream, later in it, mid-drain at the first epoch's end, just drained, and in the second epoch.
@pytest.mark.parametrize("taken", [2, 9, 19, 23, 30])
def test_state_dict_resumes_to_exactly_the_same_stream(written, taken):
    def make():
        return ActivationLoader(str(written.root), layers=list(LAYERS), batch_size=8, shuffle_tokens=48, seed=11,
                                epochs=2, return_token_ids=True, readahead=2, threads=2)  # fmt: skip

    original = make()
    for _ in range(taken):
        next(original)
    state = json.loads(json.dumps(original.state_dict()))
    assert state["draining"] == (taken in (19, 23)), "the taken counts no longer reach the phases they name"
    expected = list(original)
    resumed = make()
    resumed.load_state_dict(state)
    got = list(resumed)
    assert len(got) == len(expected) > 0
    for (a, ta), (b, tb) in zip(got, expected):
        assert np.array_equal(a, b) and np.array_equal(ta, tb)


def test_state_from_another_configuration_is_refused(written):
    state = ActivationLoader(str(written.root), layers=1, batch_size=8, shuffle_tokens=16).state_dict()
    other = ActivationLoader(str(written.root), layers=1, batch_size=8, shuffle_tokens=32)
    with pytest.raises(LoaderConfigError, match="same arguments"):
        other.load_state_dict(state)


def test_stored_statistics_match_numpy_over_the_same_tokens(written):
    from activations.reader import open_activations

    stats = open_activations(str(written.root)).stats()
    for layer in LAYERS:
        x = np.asarray(written.layers[layer], np.float64)
        s = stats[layer]
        assert s.tokens == len(x)
        np.testing.assert_allclose(s.sum, x.sum(0), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(s.sum_sq, (x**2).sum(0), rtol=1e-5)
        np.testing.assert_allclose(s.norm_sum, np.linalg.norm(x, axis=1).sum(), rtol=1e-5)


def test_kept_statistics_cover_exactly_the_tokens_the_filters_keep(written):
    filters = {"drop_token_ids": [0, 1, 2], "drop_first": 1}
    probe = ActivationLoader(str(written.root), layers=list(LAYERS), world_size=2, rank=1, **filters)
    keep = ~np.isin(written.token_ids, [0, 1, 2]) & (written.positions >= 1)
    kept = probe.kept_stats()
    for layer in LAYERS:
        x = np.asarray(written.layers[layer], np.float64)[keep]  # every rank's kept rows, not only rank 1's
        s = kept[layer]
        assert s.tokens == len(x) < len(written.token_ids)
        np.testing.assert_allclose(s.sum, x.sum(0), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(s.sum_sq, (x**2).sum(0), rtol=1e-5)
        np.testing.assert_allclose(s.norm_sum, np.linalg.norm(x, axis=1).sum(), rtol=1e-5)
    # Passed to a loader with the same filters, mean-norm scaling brings the kept rows' mean norm to sqrt(d).
    scaled = ActivationLoader(str(written.root), layers=3, batch_size=16, shuffle=False, normalize="mean_norm",
                              stats=kept, **filters)  # fmt: skip
    got = np.concatenate(list(scaled))
    assert abs(np.linalg.norm(got, axis=1).mean() - np.sqrt(HIDDEN)) < 1e-3
    # A sample of shards is an estimate over just those shards.
    two = probe.kept_stats(shards=2)[3]
    assert 0 < two.tokens < kept[3].tokens


@pytest.mark.parametrize("normalize", ["mean_norm", "standardize"])
def test_normalised_batches_use_the_stored_statistics_without_an_estimation_pass(written, normalize):
    x = np.asarray(written.layers[3], np.float64)
    batches = list(ActivationLoader(str(written.root), layers=3, batch_size=16, shuffle=False, normalize=normalize))
    got = np.concatenate(batches)
    if normalize == "mean_norm":
        expected = x * np.sqrt(HIDDEN) / np.linalg.norm(x, axis=1).mean()
        assert abs(np.linalg.norm(got, axis=1).mean() - np.sqrt(HIDDEN)) < 1e-3
    else:
        got, x = got[:, 2:], x[:, 2:]  # columns 0 and 1 hold token numbers; column 1 is constant
        expected = (x - x.mean(0)) / x.std(0)
        np.testing.assert_allclose(got.mean(0), 0, atol=1e-4)
        np.testing.assert_allclose(got.std(0), 1, atol=1e-4)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_torch_output_in_bfloat16(written):
    import torch

    batch = next(ActivationLoader(str(written.root), layers=1, batch_size=8, shuffle=False, output="torch", dtype="bfloat16"))
    assert batch.dtype == torch.bfloat16 and tuple(batch.shape) == (8, HIDDEN)
    assert np.array_equal(batch.float().numpy(), np.asarray(written.layers[1][:8], np.float32))


def test_bad_arguments_name_the_field(written):
    with pytest.raises(LoaderConfigError, match="layers"):
        ActivationLoader(str(written.root), layers=7)
    with pytest.raises(LoaderConfigError, match="shuffle_tokens"):
        ActivationLoader(str(written.root), batch_size=64, shuffle_tokens=8)
    with pytest.raises(LoaderConfigError, match="rank"):
        ActivationLoader(str(written.root), rank=2, world_size=2)


def test_gcs_stream_equals_local_and_a_second_epoch_comes_from_the_cache(written, gcs, gcs_bucket, gcs_client, tmp_path):
    bucket = gcs_client.bucket(gcs_bucket)
    for path in written.root.rglob("*"):
        if path.is_file() and ".objectstore" not in path.parts:
            bucket.blob(f"q/{path.relative_to(written.root).as_posix()}").upload_from_filename(str(path))
    # The done markers name local paths; a copy in a bucket is read as a prefix of shards.
    url = f"gs://{gcs_bucket}/q/out"
    local = keys_of(ActivationLoader(str(written.root / "out"), layers=1, batch_size=8, shuffle_tokens=32, seed=2))
    gcs.reset_counts()
    remote = ActivationLoader(url, layers=1, batch_size=8, shuffle_tokens=32, seed=2, epochs=2, readahead=0,
                              cache_dir=str(tmp_path / "cache"), client=gcs_client)  # fmt: skip
    first_epoch = [Written.row_key(next(remote)) for _ in range(len(local))]
    assert all(np.array_equal(a, b) for a, b in zip(first_epoch, local, strict=True))
    shards = len(written.records)
    assert gcs.counts()["reads"] >= 2 * shards  # a header and the layer's rows per shard
    gcs.reset_counts()
    second_epoch = keys_of(remote)
    assert sorted(np.concatenate(second_epoch).tolist()) == list(range(len(written.token_ids)))
    assert gcs.counts()["reads"] == shards  # headers only: the rows come from the cache


def test_a_bounded_cache_keeps_the_most_recent_ranges_under_its_size(tmp_path):
    from activations.io import RangeCache

    def entry(cache, name, size, fill):
        cache.put(f"gs://b/{name}", 0, size, memoryview(bytes([fill]) * size))

    def held(cache, name, size):
        out = bytearray(size)
        return cache.get(f"gs://b/{name}", 0, size, memoryview(out)) and out == bytes([out[0]]) * size

    cache = RangeCache(tmp_path / "c", max_bytes=300)
    entry(cache, "a", 100, 1)
    entry(cache, "b", 100, 2)
    entry(cache, "c", 100, 3)
    assert held(cache, "a", 100)  # a is now the most recently used
    entry(cache, "d", 100, 4)  # over 300: b, the least recently used, goes
    assert [held(cache, n, 100) for n in "abcd"] == [True, False, True, True]
    on_disk = sum(p.stat().st_size for p in (tmp_path / "c").rglob("*.bin"))
    assert on_disk == cache.bytes == 300
    entry(cache, "huge", 400, 5)  # larger than the whole cache: not kept, nothing evicted for it
    assert not held(cache, "huge", 400) and cache.bytes == 300
    # A later run over the same directory with a smaller bound starts from what is there, oldest out first.
    smaller = RangeCache(tmp_path / "c", max_bytes=200)
    assert smaller.bytes == 200
    assert sum(p.stat().st_size for p in (tmp_path / "c").rglob("*.bin")) == 200


def test_a_truncated_local_shard_is_named_not_a_crash(written, tmp_path):
    import shutil

    from activations.io import ActivationsError, ByteReader
    from activations.reader import read_header

    copy = tmp_path / "copy"
    shutil.copytree(written.root / "out", copy)
    victim = sorted(copy.rglob("*.safetensors"))[-1]
    start, end = read_header(str(victim), ByteReader()).layer(3).rows(0, 1)
    os.truncate(victim, end - 2)  # the header is whole; layer 3's rows end early
    with pytest.raises(ActivationsError, match=f"{victim.name}.*truncated"):
        list(ActivationLoader(str(copy), layers=3, batch_size=8, shuffle=False))


def test_the_loader_imports_and_reads_without_jax_or_the_queue(written):
    script = (
        "import sys\n"
        "for name in ('jax', 'flax', 'taskqueue', 'extract'):\n"
        "    sys.modules[name] = None\n"
        "from activations.loader import ActivationLoader\n"
        f"batch = next(ActivationLoader({str(written.root)!r}, layers=1, batch_size=4))\n"
        "print(batch.shape)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"(4, {HIDDEN})"


def test_memory_bound_counts_read_ahead_buffer_and_batches(written):
    loader = ActivationLoader(str(written.root), layers=1, batch_size=8, shuffle_tokens=64, readahead=3)
    biggest = max(r["tokens"] for r in written.records)
    row = HIDDEN * 2
    assert loader.memory_bound_bytes() >= 4 * biggest * row + 64 * row + 8 * HIDDEN * 4
    assert isinstance(LayerStats.zeros(HIDDEN).to_json()["sum"], list)


def test_batches_the_caller_keeps_are_never_overwritten_and_dropped_ones_are_reused(written):
    def make(**options):
        return ActivationLoader(str(written.root), layers=1, batch_size=8, shuffle_tokens=32, seed=5, dtype="bfloat16",
                                **options)  # fmt: skip

    kept = list(make())  # every batch held at once: each its own memory
    assert len({batch.__array_interface__["data"][0] for batch in kept}) == len(kept)
    copies = [np.array(batch) for batch in make()]
    assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(kept, copies, strict=True))
    # A loop that drops each batch before the next but one gets the same two arrays back, with the same rows.
    addresses, rows = set(), []
    for batch in make():
        addresses.add(batch.__array_interface__["data"][0])
        rows.append(Written.row_key(batch))
    assert len(addresses) == 2
    assert all(np.array_equal(a, Written.row_key(b)) for a, b in zip(rows, kept, strict=True))
    # torch.from_numpy holds the array, so a tensor the caller keeps is not written over either.
    import torch

    tensors = list(make(output="torch"))
    assert all(np.array_equal(t.view(torch.int16).numpy().view(np.uint16), c.view(np.uint16))
               for t, c in zip(tensors, copies, strict=True))  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [dict(shuffle_tokens=32), dict(shuffle_tokens=32, hold=0), dict(shuffle_tokens=24, drop_first=1, hold=0.5),
     dict(shuffle=False), dict(shuffle=False, drop_token_ids=[0, 1, 2])],
)  # fmt: skip
@pytest.mark.parametrize("normalize", [None, "mean_norm", "standardize"])
@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_float32_batches_are_the_stored_bits_widened_then_normalised(written, options, normalize, chunk_rows,
                                                                     monkeypatch):  # fmt: skip
    """float32 batches of one layer are widened (and normalised) a chunk at a time as they are gathered: the same
    values as the stored bfloat16 stream widened, then shifted and scaled in float32. At these rows' width a batch
    is one chunk; chunks of 3 rows are the case of real widths (36 rows of 7 KiB a chunk)."""
    if chunk_rows:
        import activations.shuffle

        monkeypatch.setattr(activations.shuffle, "CHUNK_BYTES", chunk_rows * HIDDEN * 2)

    def stream(dtype: str) -> list[np.ndarray]:
        with ActivationLoader(str(written.root), layers=3, batch_size=8, seed=6, epochs=2, dtype=dtype,
                              normalize=normalize if dtype == "float32" else None, **options) as loader:  # fmt: skip
            return [np.array(batch) for batch in loader]

    widened, stored = stream("float32"), stream("bfloat16")
    assert len(widened) == len(stored) > 10
    stats = open_activations(str(written.root)).stats()[3]
    for got, bits in zip(widened, stored):
        want = bits.astype(np.float32)
        if normalize == "mean_norm":
            want = want * np.float32(np.sqrt(HIDDEN) / stats.mean_norm)
        elif normalize == "standardize":
            want = (want - stats.mean.astype(np.float32)) * (1.0 / np.maximum(stats.std, 1e-6)).astype(np.float32)
        assert got.dtype == np.float32 and np.array_equal(got, want)


def test_a_batchs_rows_are_ordered_by_numpys_stable_sort_of_their_shards_whatever_the_span():
    """The batch's grouping sorts its rows' shard places by radix when they span under 2^16 values, else by numpy's
    merge sort: the same order either way, at the boundary too."""
    from activations.shuffle import stable_order as _stable_order

    rng = np.random.default_rng(1)
    for low, span in [(0, 0), (0, 5), (100_000, 30), (7, (1 << 16) - 1), (7, 1 << 16), (0, 70_000)]:
        keys = (low + rng.integers(0, span + 1, 3000)).astype(np.int32)
        keys[:2] = low, low + span  # the span's ends are in the batch
        assert np.array_equal(_stable_order(keys), np.argsort(keys, kind="stable")), (low, span)
