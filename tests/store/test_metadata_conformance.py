"""Inserts carry custom metadata only when there is some: `"metadata": null` is a 500 on stricter servers."""

from __future__ import annotations


from objectstore.gcs import GCSStore, RetryPolicy


def test_put_without_metadata_sends_no_metadata_key(gcs, gcs_client, gcs_bucket):
    # A short deadline: before the fix the 500 was retried until the store gave up.
    store = GCSStore(gcs_bucket, "q", client=gcs_client, policy=RetryPolicy(initial_s=0.01, cap_s=0.02, deadline_s=0.5))
    generation = store.put("out/a.bin", b"shard")
    assert generation > 0 and store.read("out/a.bin").data == b"shard"
    assert gcs.counts()["writes"] == 1  # one request, no retried 500s
    [entry] = store.list("out/")
    assert entry.metadata == {}


def test_put_with_metadata_still_carries_it(gcs_client, gcs_bucket):
    store = GCSStore(gcs_bucket, "q", client=gcs_client)
    store.put("out/b.bin", b"x", metadata={"rows": "3"})
    assert [e.metadata for e in store.list("out/")] == [{"rows": "3"}]
