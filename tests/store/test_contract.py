"""The object-store contract, run identically against the local store and the GCS store."""

import multiprocessing

import pytest

from objectstore import BadObjectName, NotFound, PreconditionFailed, open_store
from tests.simworld.store import SimStore


def test_create_if_absent_refuses_second_writer(store):
    generation = store.create("leases/a.json", b"first")
    with pytest.raises(PreconditionFailed):
        store.create("leases/a.json", b"second")
    blob = store.read("leases/a.json")
    assert (blob.data, blob.generation) == (b"first", generation)


def test_write_requires_current_generation(store):
    first = store.create("x", b"1")
    second = store.write("x", b"2", if_generation=first)
    assert second > first
    with pytest.raises(PreconditionFailed):
        store.write("x", b"3", if_generation=first)
    assert store.read("x").data == b"2"


def test_write_to_missing_object_is_a_precondition_failure(store):
    with pytest.raises(PreconditionFailed):
        store.write("missing", b"x", if_generation=12345)


def test_delete_is_conditional(store):
    generation = store.create("d", b"x")
    with pytest.raises(PreconditionFailed):
        store.delete("d", if_generation=generation + 1)
    store.delete("d", if_generation=generation)
    with pytest.raises(NotFound):
        store.read("d")
    with pytest.raises(NotFound):
        store.delete("d", if_generation=generation)


def test_generations_only_grow(store):
    seen = []
    for k in range(5):
        seen.append(store.put(f"g/{k}", b"x"))
    seen.append(store.write("g/0", b"y", if_generation=seen[0]))
    assert seen == sorted(seen) and len(set(seen)) == len(seen)


def test_listing_paginates_in_name_order_with_metadata(store):
    names = [f"tasks/t{k:03d}.json" for k in range(7)]
    for name in reversed(names):
        store.create(name, b"{}", metadata={"manifest": name})
    store.put("tasksx", b"not under the prefix")
    first = store.list_page("tasks/", page_size=3)
    assert [e.name for e in first.entries] == names[:3] and first.next_token
    second = store.list_page("tasks/", page_token=first.next_token, page_size=3)
    assert [e.name for e in second.entries] == names[3:6]
    assert [e.name for e in store.list("tasks/")] == names
    assert [e.metadata["manifest"] for e in store.list("tasks/")] == names
    assert all(e.size == 2 and e.generation > 0 for e in store.list("tasks/"))


def test_listing_start_offset_and_limit(store):
    for k in range(6):
        store.put(f"done/t{k}.json", b"{}")
    names = [e.name for e in store.list("done/", start_offset="done/t3.json")]
    assert names == ["done/t3.json", "done/t4.json", "done/t5.json"]
    assert [e.name for e in store.list("done/", limit=2)] == ["done/t0.json", "done/t1.json"]


def test_put_file_streams_a_local_file(store, tmp_path):
    source = tmp_path / "weights.bin"
    source.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    first = store.put_file("models/m/weights.bin", source)
    second = store.put_file("models/m/weights.bin", source)
    assert second > first
    assert store.read("models/m/weights.bin").data == source.read_bytes()


def test_open_read_is_seekable(store):
    store.put("blob.bin", bytes(range(256)) * 100)
    with store.open_read("blob.bin") as handle:
        handle.seek(1000)
        assert handle.read(4) == bytes([1000 % 256, 1001 % 256, 1002 % 256, 1003 % 256])
    with pytest.raises(NotFound):
        store.open_read("nope")


def test_child_store_shares_the_namespace(store):
    child = store.child("out/t1/42")
    child.put("part-0", b"abc")
    assert store.read("out/t1/42/part-0").data == b"abc"
    assert child.url("part-0") == store.url("out/t1/42/part-0")
    assert [e.name for e in child.list("")] == ["part-0"]
    if not isinstance(store, SimStore):  # (the simulated bucket is reached through its object only)
        assert open_store(child.url("part-0").rsplit("/", 1)[0]).read("part-0").data == b"abc"


@pytest.mark.parametrize("name", ["", "/abs", "a/../b", "a//b", "a/./b"])
def test_bad_object_names_are_rejected(store, name):
    with pytest.raises(BadObjectName):
        store.put(name, b"x")


def _race_create(root: str, name: str, worker: int, results) -> None:
    try:
        open_store(root).create(name, str(worker).encode())
        results.put(worker)
    except PreconditionFailed:
        results.put(None)


def test_local_create_has_one_winner_across_processes(tmp_path):
    root = str(tmp_path / "bucket")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    for round_ in range(3):
        procs = [ctx.Process(target=_race_create, args=(root, f"r{round_}", w, results)) for w in range(6)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        outcomes = [results.get(timeout=5) for _ in procs]
        winners = [w for w in outcomes if w is not None]
        assert len(winners) == 1
        assert open_store(root).read(f"r{round_}").data == str(winners[0]).encode()


# -- GCS-only: what the transport can do to a request ----------------------------------------


def test_transient_errors_are_retried(gcs, gcs_store):
    gcs.faults.fail_next(3, 503)
    gcs.faults.fail_next(2, 429)
    gcs_store.create("a", b"x")
    assert gcs_store.read("a").data == b"x"
    assert gcs.counts()["faults_injected"] == 5


def test_transient_errors_beyond_the_deadline_raise_store_unavailable(gcs, gcs_client, gcs_bucket):
    from objectstore import StoreUnavailable
    from objectstore.gcs import GCSStore, RetryPolicy

    impatient = GCSStore(gcs_bucket, "q", client=gcs_client, policy=RetryPolicy(initial_s=0.01, cap_s=0.02, deadline_s=0.3))
    gcs.faults.fail_fraction(1.0, 503)
    with pytest.raises(StoreUnavailable, match="create gs://"):
        impatient.create("a", b"x")


def test_ambiguous_create_that_was_ours_is_recognised(gcs, gcs_store):
    gcs.faults.drop_after_apply(1, method="POST", name_contains="leases/a.json")
    generation = gcs_store.create("leases/a.json", b"mine")
    assert gcs.counts()["reads"] == 1  # the read-back that recognised our nonce
    blob = gcs_store.read("leases/a.json")
    assert (blob.data, blob.generation) == (b"mine", generation)
    assert gcs.counts()["faults_injected"] == 1


def test_ambiguous_write_that_was_ours_is_recognised(gcs, gcs_store):
    first = gcs_store.create("leases/b.json", b"v1")
    gcs.faults.drop_after_apply(1, method="POST", name_contains="leases/b.json")
    second = gcs_store.write("leases/b.json", b"v2", if_generation=first)
    assert gcs_store.read("leases/b.json").generation == second > first


def test_create_retried_after_a_transient_error_onto_another_writers_object_fails(gcs, gcs_store):
    open_store(gcs_store.root_url).create("leases/c.json", b"theirs")
    # Our first attempt is answered 503; the retry meets the other writer's object (412), and the
    # read-back finds their nonce, not ours.
    gcs.faults.fail_next(1, 503, method="POST", name_contains="leases/c.json")
    gcs.reset_counts()
    with pytest.raises(PreconditionFailed, match="another writer"):
        gcs_store.create("leases/c.json", b"mine")
    assert gcs.counts()["reads"] == 1
    assert gcs_store.read("leases/c.json").data == b"theirs"


def test_first_attempt_412_needs_no_read_back(gcs, gcs_store):
    gcs_store.create("leases/e.json", b"theirs")
    gcs.reset_counts()
    with pytest.raises(PreconditionFailed):
        gcs_store.create("leases/e.json", b"mine")
    assert gcs.counts()["reads"] == 0


def test_delete_retried_after_lost_response_succeeds(gcs, gcs_store):
    generation = gcs_store.create("leases/d.json", b"x")
    gcs.faults.drop_after_apply(1, kind="delete")
    gcs_store.delete("leases/d.json", if_generation=generation)
    with pytest.raises(NotFound):
        gcs_store.read("leases/d.json")
