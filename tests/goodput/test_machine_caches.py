"""What a machine keeps between tasks, checked before it is trusted: compilation-cache entries (their seals, and
their copies through the bucket) and the weights copy (generation, size, CRC32C, stamp). No JAX compile here: the
entries are bytes as JAX would write them; tests/goodput/test_compile_cache.py runs the real compiles."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import random

import google_crc32c
import numpy as np
import pytest

import objectstore
from extract import compilecache, weightcache
from extract.errors import BadInput
from extract.weights import INDEX_FILE, Checkpoint

ENTRY = f"jit_forward-{'a' * 64}{compilecache.ENTRY_SUFFIX}"


# -- compilation-cache entries ------------------------------------------------------------------------------------

#: How an entry may be found at start-up, and whether it may be kept.
ENTRY_STATES = {
    "sealed": True,
    "unsealed": False,  # a writer killed between JAX's write and the seal, or mid-write
    "bytes_changed": False,
    "truncated": False,
    "seal_unreadable": False,
}


def make_entry(directory: pathlib.Path, name: str, state: str) -> bytes:
    data = random.Random(name).randbytes(3000)
    path = directory / name
    path.write_bytes(data)
    seal = compilecache.Seal.of(data)
    if state == "unsealed":
        return data
    if state == "seal_unreadable":
        pathlib.Path(f"{path}{compilecache.SEAL_SUFFIX}").write_text("{not json")
        return data
    pathlib.Path(f"{path}{compilecache.SEAL_SUFFIX}").write_text(f'{{"size": {seal.size}, "crc32c": "{seal.crc32c}"}}')
    if state == "bytes_changed":
        path.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif state == "truncated":
        path.write_bytes(data[:1500])
    return data


@pytest.mark.parametrize("states", list(itertools.combinations(ENTRY_STATES, 2)) + [(s,) for s in ENTRY_STATES])
def test_startup_check_keeps_exactly_the_entries_that_match_their_seal(tmp_path, states):
    names = {state: f"jit_{state}-{k:064x}{compilecache.ENTRY_SUFFIX}" for k, state in enumerate(states)}
    for state, name in names.items():
        make_entry(tmp_path, name, state)
    (tmp_path / f"gone{compilecache.ENTRY_SUFFIX}{compilecache.SEAL_SUFFIX}").write_text("{}")  # a seal left alone
    cache = compilecache.CompileCache(tmp_path)
    checked = cache.check()
    kept = {state for state in states if ENTRY_STATES[state]}
    assert checked == {"kept": len(kept), "removed": len(states) - len(kept)}
    assert {p.name for p in cache.entries()} == {names[s] for s in kept}
    left = {p.name for p in tmp_path.iterdir()} - {compilecache.LOCK_NAME}
    assert left == {names[s] for s in kept} | {f"{names[s]}{compilecache.SEAL_SUFFIX}" for s in kept}


def test_a_compile_seals_what_it_wrote_and_shares_it_with_a_second_machine_through_the_bucket(tmp_path, gcs_client, gcs_bucket):
    shared = f"gs://{gcs_bucket}/jax-cache/ns"
    one = compilecache.CompileCache(tmp_path / "one", objectstore.open_store(shared))
    with one.compiling():  # JAX writes the entry while the program compiles
        data = random.Random(1).randbytes(5000)
        (tmp_path / "one" / ENTRY).write_bytes(data)
    assert one._read_seal(tmp_path / "one" / ENTRY) == compilecache.Seal.of(data)
    (listed,) = objectstore.open_store(shared).list("")
    assert listed.name == ENTRY and listed.metadata == {"size": "5000", "crc32c": compilecache.Seal.of(data).crc32c}

    two = compilecache.CompileCache(tmp_path / "two", objectstore.open_store(shared))
    assert two.pull() == 1 and (tmp_path / "two" / ENTRY).read_bytes() == data
    assert two.check() == {"kept": 1, "removed": 0}
    assert two.pull() == 0  # already here


def test_a_shared_entry_that_does_not_match_its_uploaders_seal_is_not_copied_in(tmp_path, gcs_client, gcs_bucket):
    shared = objectstore.open_store(f"gs://{gcs_bucket}/jax-cache/ns")
    data = random.Random(2).randbytes(4000)
    seal = compilecache.Seal.of(data)
    shared.create(ENTRY, data[:-1] + b"\0", metadata={"size": str(seal.size), "crc32c": seal.crc32c})
    cache = compilecache.CompileCache(tmp_path, shared)
    assert cache.pull() == 0 and cache.entries() == []


def test_the_namespace_changes_with_each_part_of_the_build_and_device():
    base = ("0.10.2", "0.10.2", "tpu", "libtpu 1", "TPU v6 lite")
    others = [base[:k] + (value,) + base[k + 1 :] for k, value in enumerate(("0.10.3", "0.10.3", "gpu", "libtpu 2", "TPU v5 lite"))]
    names = {compilecache.namespace(*parts) for parts in [base, *others]}
    assert len(names) == 1 + len(others)


def test_the_cache_is_off_or_moved_by_its_settings(monkeypatch, tmp_path):
    monkeypatch.delenv(compilecache.JAX_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(compilecache.ENV, raising=False)
    assert compilecache.default_root() == tmp_path / "xdg" / "gcs-spawner" / "jax"
    monkeypatch.setenv(compilecache.JAX_ENV, str(tmp_path / "jax"))
    assert compilecache.default_root() == tmp_path / "jax"
    monkeypatch.setenv(compilecache.ENV, str(tmp_path / "ours"))
    assert compilecache.default_root() == tmp_path / "ours"
    monkeypatch.setenv(compilecache.ENV, "off")
    assert compilecache.default_root() is None


# -- the weights copy ---------------------------------------------------------------------------------------------


def test_crc32c_of_pieces_equals_the_whole_files():
    data = os.urandom(100_003)
    for piece in (1, 3, 64, 4096, 33_333, 100_003, 200_000):
        parts = [data[i : i + piece] for i in range(0, len(data), piece)]
        combined = weightcache.crc32c_of_pieces([google_crc32c.value(p) for p in parts], [len(p) for p in parts])
        assert combined == google_crc32c.value(data), piece


def write_bucket_model(url: str, tmp_path: pathlib.Path, shards: int = 2) -> dict[str, np.ndarray]:
    """Two safetensors shards and their index in the bucket; the tensors by name."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    local = tmp_path / "model-src"
    local.mkdir()
    tensors, weight_map = {}, {}
    for k in range(shards):
        part = {f"model.layers.{k}.mlp.up_proj.weight": rng.standard_normal((64, 32)).astype(np.float32)}
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(local / name))
        tensors |= part
        weight_map |= dict.fromkeys(part, name)
    (local / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    store = objectstore.open_store(url)
    for path in sorted(local.iterdir()):
        store.put_file(path.name, path)
    return tensors


def copies(cache_root: pathlib.Path, url: str) -> pathlib.Path:
    return cache_root / url.removeprefix("gs://").strip("/")


def test_weights_are_read_from_the_bucket_once_and_then_from_the_machines_copy(tmp_path, gcs, gcs_client, gcs_bucket):
    url = f"gs://{gcs_bucket}/model"
    tensors = write_bucket_model(url, tmp_path)
    root = tmp_path / "cache"
    gcs.reset_counts()
    first = weightcache.open_checkpoint(url, root)
    first_reads = gcs.counts()["reads"]
    assert {name: np.asarray(first.read(name)).tolist() for name in tensors} == {k: v.tolist() for k, v in tensors.items()}
    assert isinstance(first.model_dir, pathlib.Path)  # a local copy, memory-mapped
    gcs.reset_counts()
    second = weightcache.open_checkpoint(url, root)
    assert all(np.array_equal(second.read(name), value) for name, value in tensors.items())
    # The second load lists the bucket and reads the index; the weights themselves are not read again.
    assert gcs.counts()["reads"] == 1 < first_reads


@pytest.mark.parametrize("damage", ["bytes_changed", "truncated", "record_removed", "new_generation"])
def test_a_damaged_or_outdated_weights_copy_is_detected_and_copied_again(tmp_path, gcs_client, gcs_bucket, damage):
    url = f"gs://{gcs_bucket}/model"
    tensors = write_bucket_model(url, tmp_path)
    root = tmp_path / "cache"
    weightcache.open_checkpoint(url, root)
    shard = copies(root, url) / "model-00001-of-00002.safetensors"
    original = shard.read_bytes()
    if damage == "bytes_changed":
        with open(shard, "r+b") as f:  # one byte of the tensor data, the size unchanged
            f.seek(len(original) - 5)
            f.write(bytes([original[-5] ^ 0x40]))
    elif damage == "truncated":
        shard.write_bytes(original[:-100])
    elif damage == "record_removed":
        weightcache._record_path(shard).unlink()
    else:  # the bucket's object rewritten (a new mirror): same bytes, new generation
        objectstore.open_store(url).put_file(shard.name, tmp_path / "model-src" / shard.name)
    cache = weightcache.WeightCache(objectstore.open_store(url), copies(root, url))
    assert cache.sync() == copies(root, url)
    assert cache.checked == {"reused": 1, "copied": 0, "rebuilt": 1}
    assert shard.read_bytes() == original
    checkpoint = Checkpoint(copies(root, url))
    assert all(np.array_equal(checkpoint.read(name), value) for name, value in tensors.items())


def test_every_later_load_rechecks_the_crc_when_asked_to(tmp_path):
    """With $EXTRACT_WEIGHTS_VERIFY=always a copy is checked byte by byte even when its stamp is unchanged. The
    bucket here is a directory, which reports no CRC32C: only the record's can be compared."""
    url = str(tmp_path / "bucket")
    write_bucket_model(url, tmp_path)
    root = tmp_path / "cache"
    weightcache.open_checkpoint(url, root)
    shard = copies(root, url) / "model-00002-of-00002.safetensors"
    record = weightcache._read_record(shard)
    # A record that says another CRC32C, the file's stamp intact: only a full check can notice.
    weightcache._write_record(shard, weightcache.Record(record.generation, record.size, "AAAAAA==", record.stamp, record.boot))
    entry = next(e for e in objectstore.open_store(url).list("") if e.name == shard.name)
    cache = weightcache.WeightCache(objectstore.open_store(url), copies(root, url))
    assert entry.crc32c is None and cache.sound(entry)
    cache.verify_always = True
    assert not cache.sound(entry)


def test_weights_are_read_in_place_when_the_disk_cannot_hold_the_copy(tmp_path, gcs_client, gcs_bucket, monkeypatch):
    url = f"gs://{gcs_bucket}/model"
    write_bucket_model(url, tmp_path)
    monkeypatch.setattr(weightcache, "RESERVE_BYTES", 2**62)
    checkpoint = weightcache.open_checkpoint(url, tmp_path / "cache")
    assert checkpoint.store is not None  # ranged reads from the bucket, as without the cache
    assert not list((copies(tmp_path / "cache", url)).glob("*.safetensors"))


def test_a_file_the_index_names_but_the_bucket_lacks_is_bad_input(tmp_path, gcs_client, gcs_bucket):
    url = f"gs://{gcs_bucket}/model"
    write_bucket_model(url, tmp_path)
    objectstore.open_store(url).delete("model-00002-of-00002.safetensors")
    with pytest.raises(BadInput, match="model-00002-of-00002.safetensors named by model.safetensors.index.json"):
        weightcache.open_checkpoint(url, tmp_path / "cache")


def test_the_engine_loads_a_bucket_model_from_the_copy_and_refuses_a_step_that_cannot_fit_before_copying(
    tmp_path, gcs_client, gcs_bucket, monkeypatch
):
    import jax

    from extract.engine import Engine
    from extract.memory import DeviceMemoryError
    from extract.tiny import write_tiny_qwen
    from extract.weights import upload_model_dir

    model = write_tiny_qwen(tmp_path / "model", seed=4)
    url = f"gs://{gcs_bucket}/tiny"
    upload_model_dir(model, url)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    args = dict(batch_size=1, max_seq_len=16, devices=jax.devices()[:1])
    with pytest.raises(DeviceMemoryError):
        Engine(url, [-1], device_memory=1000, **args)
    assert not list((tmp_path / "xdg").rglob("*.safetensors"))  # refused before a byte of weights was copied

    from_bucket, from_disk = Engine(url, [-1], **args), Engine(str(model), [-1], **args)
    (copy,) = (tmp_path / "xdg").rglob("*.safetensors")
    assert copy.read_bytes() == (model / "model.safetensors").read_bytes()
    leaves = jax.tree.leaves(from_bucket._state), jax.tree.leaves(from_disk._state)
    assert len(leaves[0]) == len(leaves[1]) and all(np.array_equal(a, b) for a, b in zip(*leaves))


def test_a_sound_copy_gives_the_headers_without_reading_the_buckets_weights_files(tmp_path, gcs, gcs_client, gcs_bucket):
    """Issue 44: a warm load read up to 8 MiB of every safetensors file from the bucket for its header."""
    url = f"gs://{gcs_bucket}/model"
    tensors = write_bucket_model(url, tmp_path)
    root = tmp_path / "cache"
    assert weightcache.reused_checkpoint(url, root) is None  # no copy yet: nothing is copied here either
    assert not list(root.rglob("*.safetensors"))
    weightcache.open_checkpoint(url, root)
    gcs.reset_counts()
    checkpoint = weightcache.reused_checkpoint(url, root)
    assert gcs.counts()["reads"] == 1, "the index only; the two files' headers come from the copies"
    assert checkpoint.model_dir == copies(root, url) and checkpoint.store is None
    assert all(np.array_equal(checkpoint.read(name), value) for name, value in tensors.items())
    (copies(root, url) / "model-00002-of-00002.safetensors").write_bytes(b"changed")
    assert weightcache.reused_checkpoint(url, root) is None  # a changed copy is not sound: the caller copies again
