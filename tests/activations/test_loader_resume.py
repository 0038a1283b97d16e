"""Resume is exact from every checkpoint: each `state_dict()` an uninterrupted run passes through, loaded into a fresh
loader, gives the rest of that run bit for bit (activations and token ids).

Exhaustive over the checkpoints of small jobs (every one, not chosen ones: #26's bug hit 1-15% of them, and the
first checkpoints of every epoch when the buffer is smaller than a shard), and randomized with hypothesis over shard
sizes, batch and buffer sizes, ranks, filters, epochs, how long shards are held (`hold`) and checkpoint positions.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from activations.format import encode_safetensors, layer_key, shard_name
from activations.loader import ActivationLoader
from tests.activations.conftest import LAYERS, Written

Batch = tuple[np.ndarray, np.ndarray]  # (activations as raw 16-bit words, token ids)


def run_with_states(make) -> tuple[list[Batch], list[dict]]:
    """Every batch of an uninterrupted run, and the state before each batch and after the last (JSON round-tripped,
    as a checkpoint file would hold it)."""
    loader = make()
    states = [json.loads(json.dumps(loader.state_dict()))]
    batches = []
    for activations, token_ids in loader:
        batches.append((np.asarray(activations).view(np.uint16), np.asarray(token_ids)))
        states.append(json.loads(json.dumps(loader.state_dict())))
    loader.close()
    return batches, states


def resumed_from(make, state: dict) -> list[Batch]:
    with make() as loader:
        loader.load_state_dict(state)
        return [(np.asarray(a).view(np.uint16), np.asarray(t)) for a, t in loader]


def assert_resumes_exactly(make, batches: list[Batch], state: dict, checkpoint: int) -> None:
    rest = resumed_from(make, state)
    assert len(rest) == len(batches) - checkpoint, f"resumed after batch {checkpoint}: wrong number of batches"
    for k, ((got, got_ids), (want, want_ids)) in enumerate(zip(rest, batches[checkpoint:])):
        where = f"resumed after batch {checkpoint} of {len(batches)}: batch {checkpoint + k}"
        same_ids, same_rows = np.array_equal(got_ids, want_ids), np.array_equal(got, want)
        assert same_ids, f"{where}: token ids differ"
        differ = int((got != want).reshape(len(got), -1).any(-1).sum()) if got.shape == want.shape else "all"
        assert same_rows, f"{where}: activations differ in {differ} rows"


# -- exhaustive: every checkpoint of a real writer's job (tests/activations/conftest.py: 12 shards, 221 tokens) -------

CASES = {
    "buffer-smaller-than-a-shard": dict(batch_size=3, shuffle_tokens=7),
    "every-row-spilled": dict(batch_size=4, shuffle_tokens=10, hold=0),
    "buffer-larger-than-the-dataset": dict(batch_size=16, shuffle_tokens=300),
    "buffer-equal-to-the-batch": dict(batch_size=8, shuffle_tokens=8),
    "rank-1-of-3": dict(batch_size=4, shuffle_tokens=12, rank=1, world_size=3),
    "filters": dict(batch_size=5, shuffle_tokens=16, drop_token_ids=[0, 1, 2, 3, 4], drop_first=1, positions=(0, 9)),
    "three-epochs-drop-last": dict(batch_size=6, shuffle_tokens=20, epochs=3, drop_last=True),
    "unshuffled-two-epochs-rank-0-of-2": dict(batch_size=7, shuffle=False, epochs=2, rank=0, world_size=2),
}


def kept_per_rank(written: Written, rank: int, world_size: int, drop_token_ids=(), drop_first=0, positions=(0, None)):
    """Token numbers the loader must give this rank in one epoch: its rows of every shard, less the filtered."""
    starts = np.cumsum([0] + [record["tokens"] for record in written.records])
    mine = np.zeros(len(written.token_ids), bool)
    for lo, hi in zip(starts[:-1], starts[1:]):
        n = hi - lo
        mine[lo + n * rank // world_size : lo + n * (rank + 1) // world_size] = True
    first, last = positions
    keep = mine & ~np.isin(written.token_ids, list(drop_token_ids)) & (written.positions >= max(first, drop_first))
    if last is not None:
        keep &= written.positions < last
    return np.flatnonzero(keep)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_resume_from_every_checkpoint_gives_the_rest_of_the_stream_bit_for_bit(written, case, seed):
    options = CASES[case]

    def make():
        return ActivationLoader(str(written.root), layers=list(LAYERS), seed=seed, dtype="bfloat16",
                                return_token_ids=True, readahead=1, threads=1, **options)  # fmt: skip

    batches, states = run_with_states(make)
    # The uninterrupted run is right to begin with: each epoch is this rank's kept tokens once, each row with its
    # own token id, and both layers of a row are the same token.
    keys = [Written.row_key(a[:, 0].view(ml_dtypes.bfloat16)) for a, _ in batches]
    for (activations, token_ids), key in zip(batches, keys):
        assert np.array_equal(token_ids, written.token_ids[key])
        assert np.array_equal(key, Written.row_key(activations[:, 1].view(ml_dtypes.bfloat16)))
    filters = {k: options[k] for k in ("drop_token_ids", "drop_first", "positions") if k in options}
    expected = kept_per_rank(written, options.get("rank", 0), options.get("world_size", 1), **filters)
    stream, epochs = np.concatenate(keys), options.get("epochs", 1)
    if options.get("drop_last"):
        assert all(len(a) == options["batch_size"] for a, _ in batches)
    else:
        assert len(stream) == epochs * len(expected)
        for epoch in range(epochs):
            assert np.array_equal(np.sort(stream[epoch * len(expected) : (epoch + 1) * len(expected)]), expected)
    assert len(batches) > 10
    for checkpoint, state in enumerate(states):
        assert_resumes_exactly(make, batches, state, checkpoint)


# -- randomized: hypothesis over shapes, ranks, filters and checkpoint positions ---------------------------------------

HIDDEN = 4


def write_shards(directory: pathlib.Path, shard_tokens: list[int], documents: list[list[int]], layers: int) -> None:
    """Shards of the format (activations.format, as the writer lays them out) whose rows name their token: column 0
    holds the token's running number as raw bits, column 1 which layer, the rest random bits."""
    rng = np.random.default_rng(len(shard_tokens))
    first = 0
    for k, (n, lengths) in enumerate(zip(shard_tokens, documents)):
        numbers = np.arange(first, first + n)
        tensors = {}
        for layer in range(layers):
            rows = rng.integers(0, 1 << 16, (n, HIDDEN), dtype=np.uint16)
            rows[:, 0], rows[:, 1] = numbers, layer
            tensors[layer_key(layer)] = rows.view(ml_dtypes.bfloat16)
        tensors["token_ids"] = (numbers * 7 % 1000).astype(np.int32)
        tensors["sample_ids"] = np.arange(len(lengths), dtype=np.int64) + 100 * k
        tensors["offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        metadata = {"format": "activations/v1", "layers": json.dumps(list(range(layers))), "hidden_size": str(HIDDEN)}
        (directory / shard_name(100 * k, 100 * k + len(lengths))).write_bytes(encode_safetensors(tensors, metadata))
        first += n


def kept_numbers(shard_tokens: list[int], documents: list[list[int]], options: dict) -> np.ndarray:
    """The running numbers of the tokens one rank keeps in an epoch: its rows of each shard, less the first
    `drop_first` positions of every document."""
    kept, first = [], 0
    rank, world_size = options["rank"], options["world_size"]
    for n, lengths in zip(shard_tokens, documents):
        positions = np.concatenate([np.zeros(0, np.int64), *[np.arange(length) for length in lengths]])
        rows = np.arange(n * rank // world_size, n * (rank + 1) // world_size)
        kept.append(first + rows[positions[rows] >= options["drop_first"]])
        first += n
    return np.sort(np.concatenate(kept))


@st.composite
def documents_of(draw, n: int) -> list[int]:
    """Document lengths that add up to n (empty documents included)."""
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
    return [b - a for a, b in zip([0, *cuts], [*cuts, n])]


@st.composite
def jobs(draw):
    shard_tokens = draw(st.lists(st.integers(0, 40), min_size=1, max_size=5))
    documents = [draw(documents_of(n)) for n in shard_tokens]
    batch_size = draw(st.integers(1, 9))
    world_size = draw(st.integers(1, 3))
    options = dict(
        batch_size=batch_size,
        shuffle=draw(st.booleans()),
        shuffle_tokens=batch_size + draw(st.integers(0, 90)),
        seed=draw(st.integers(0, 1 << 16)),
        world_size=world_size,
        rank=draw(st.integers(0, world_size - 1)),
        epochs=draw(st.integers(1, 3)),
        drop_last=draw(st.booleans()),
        drop_first=draw(st.integers(0, 2)),
        layers=draw(st.sampled_from([0, [0, 1], [1, 0]])),
        readahead=draw(st.integers(0, 2)),
        hold=draw(st.sampled_from([0, 0.25, 1, 3])),
    )
    return shard_tokens, documents, options


@settings(max_examples=120, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(job=jobs(), data=st.data())
def test_resume_at_random_checkpoints_of_random_jobs_is_exact(job, data):
    shard_tokens, documents, options = job
    with tempfile.TemporaryDirectory(prefix="loader-resume-") as directory:
        write_shards(pathlib.Path(directory), shard_tokens, documents, layers=2)

        def make():
            return ActivationLoader(directory, dtype="bfloat16", return_token_ids=True, threads=1, **options)

        batches, states = run_with_states(make)
        numbers = [a.reshape(len(t), -1, HIDDEN)[:, 0, 0].astype(np.int64) for a, t in batches]
        for (_, token_ids), number in zip(batches, numbers):  # each row with its own token id
            assert np.array_equal(token_ids, number * 7 % 1000)
        if not options["drop_last"]:  # each epoch gives this rank's kept tokens once
            expected = kept_numbers(shard_tokens, documents, options)
            stream = np.concatenate([np.zeros(0, np.int64), *numbers])
            assert len(stream) == options["epochs"] * len(expected)
            for epoch in np.split(stream, options["epochs"]):
                assert np.array_equal(np.sort(epoch), expected)
        checkpoints = data.draw(st.lists(st.integers(0, len(batches)), min_size=1, max_size=3, unique=True))
        for checkpoint in checkpoints:
            assert_resumes_exactly(make, batches, states[checkpoint], checkpoint)


@pytest.mark.parametrize("case", ["buffer-smaller-than-a-shard", "filters", "three-epochs-drop-last"])
def test_where_buffered_rows_wait_changes_nothing_emitted(written, case):
    """Rows wait in their shards until `hold` x C rows have left after their shard's last, then in the spill: hold=0
    spills every row as soon as its shard is read, a huge hold none. The stream is the same bit for bit, and each
    batch lists its rows grouped by shard, in the epoch's order of shards."""

    def stream(hold: float) -> list[Batch]:
        with ActivationLoader(str(written.root), layers=list(LAYERS), seed=3, dtype="bfloat16", return_token_ids=True,
                              hold=hold, **CASES[case]) as loader:  # fmt: skip
            return [(np.asarray(a).view(np.uint16), np.asarray(t)) for a, t in loader]

    held = stream(1e9)
    assert len(held) > 10
    for hold in (0, 0.5, 3):
        got = stream(hold)
        assert len(got) == len(held)
        for k, ((rows, ids), (want, want_ids)) in enumerate(zip(got, held)):
            assert np.array_equal(rows, want) and np.array_equal(ids, want_ids), f"hold={hold}: batch {k} differs"
    if CASES[case].get("epochs", 1) > 1:
        return  # the grouping is checked on the one-epoch cases, where each batch's epoch is the first
    starts = np.cumsum([0] + [record["tokens"] for record in written.records])
    place = np.argsort(np.random.default_rng([3, 0, 0]).permutation(len(written.records)))  # epoch 0's order
    for rows, _ in held:
        shard = np.searchsorted(starts, Written.row_key(rows[:, 0].view(ml_dtypes.bfloat16)), side="right") - 1
        assert (np.diff(place[shard]) >= 0).all(), "a batch's rows are not grouped by shard in the epoch's order"
