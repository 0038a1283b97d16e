"""The fake GCS server seen through the real google-cloud-storage client: buckets, uploads, reads, listings."""

from __future__ import annotations

import base64
import io
import os

import google_crc32c
import pytest
import requests
from google.api_core import exceptions

CHUNK = 256 * 1024  # the client's resumable chunk granularity


def payload(size: int) -> bytes:
    return os.urandom(size)


def test_bucket_create_get_and_conflict(gcs, gcs_client):
    created = gcs_client.create_bucket("fresh-bucket-objects-test")
    assert gcs_client.get_bucket("fresh-bucket-objects-test").name == created.name
    with pytest.raises(exceptions.Conflict):
        gcs_client.create_bucket("fresh-bucket-objects-test")
    with pytest.raises(exceptions.NotFound):
        gcs_client.get_bucket("no-such-bucket-here")


def test_upload_to_missing_bucket_is_not_found(gcs_client):
    with pytest.raises(exceptions.NotFound):
        gcs_client.bucket("no-such-bucket-here").blob("x").upload_from_string(b"x", retry=None)


def test_multipart_upload_round_trips_bytes_type_and_checksums(gcs_client, gcs_bucket):
    body = payload(4096)
    blob = gcs_client.bucket(gcs_bucket).blob("dir/sub dir/ünïcode name.bin")
    blob.upload_from_string(body, content_type="application/x-test")
    assert blob.size == len(body) and blob.metageneration == 1 and blob.generation > 0

    fresh = gcs_client.bucket(gcs_bucket).blob("dir/sub dir/ünïcode name.bin")
    assert fresh.download_as_bytes() == body  # the client verifies x-goog-hash crc32c itself
    assert fresh.generation == blob.generation  # taken from the x-goog-generation header
    assert fresh.content_type == "application/x-test"
    expected_crc = base64.b64encode(google_crc32c.value(body).to_bytes(4, "big")).decode()
    assert fresh.crc32c == expected_crc == blob.crc32c


def test_empty_object_round_trips(gcs_client, gcs_bucket):
    blob = gcs_client.bucket(gcs_bucket).blob("empty")
    blob.upload_from_string(b"")
    assert blob.size == 0
    assert gcs_client.bucket(gcs_bucket).blob("empty").download_as_bytes() == b""
    with gcs_client.bucket(gcs_bucket).blob("empty").open("rb") as reader:
        assert reader.read() == b""


def test_media_download_headers_carry_generation_hash_and_length(gcs, gcs_client, gcs_bucket):
    body = payload(1000)
    blob = gcs_client.bucket(gcs_bucket).blob("headers.bin")
    blob.upload_from_string(body)
    for url in (f"{gcs.url}/download/storage/v1/b/{gcs_bucket}/o/headers.bin?alt=media",
                f"{gcs.url}/storage/v1/b/{gcs_bucket}/o/headers.bin?alt=media"):
        response = requests.get(url, timeout=10)
        assert response.status_code == 200 and response.content == body
        assert response.headers["x-goog-generation"] == str(blob.generation)
        assert response.headers["x-goog-metageneration"] == "1"
        assert response.headers["x-goog-stored-content-length"] == str(len(body))
        assert response.headers["x-goog-hash"] == f"crc32c={blob.crc32c},md5={blob.md5_hash}"


def test_resumable_upload_in_chunks_commits_once_at_the_last_byte(gcs, gcs_client, gcs_bucket):
    body = payload(2 * CHUNK + 1234)
    blob = gcs_client.bucket(gcs_bucket).blob("resumable.bin", chunk_size=CHUNK)
    blob.upload_from_file(io.BytesIO(body))  # no size given: the client must use a resumable session
    assert blob.size == len(body)
    assert gcs.counts()["writes"] == 1 + 3  # initiate, then three chunks
    assert gcs_client.bucket(gcs_bucket).blob("resumable.bin").download_as_bytes() == body

    with gcs_client.bucket(gcs_bucket).blob("writer.bin", chunk_size=CHUNK).open("wb") as writer:
        writer.write(body)
    assert gcs_client.bucket(gcs_bucket).blob("writer.bin").download_as_bytes() == body


def test_resumable_session_answers_status_queries_and_resent_chunks(gcs, gcs_client, gcs_bucket):
    body = payload(CHUNK + 100)
    session_url = gcs_client.bucket(gcs_bucket).blob("session.bin").create_resumable_upload_session(
        content_type="application/x-session", size=len(body))
    http = requests.Session()

    def put(content_range: str, data: bytes = b"") -> requests.Response:
        return http.put(session_url, data=data, headers={"Content-Range": content_range}, timeout=10)

    status = put(f"bytes */{len(body)}")
    assert status.status_code == 308 and "Range" not in status.headers
    first = put(f"bytes 0-{CHUNK - 1}/{len(body)}", body[:CHUNK])
    assert first.status_code == 308 and first.headers["Range"] == f"bytes=0-{CHUNK - 1}"
    resent = put(f"bytes 0-{CHUNK - 1}/{len(body)}", body[:CHUNK])  # a retry of a chunk already held
    assert resent.status_code == 308 and resent.headers["Range"] == f"bytes=0-{CHUNK - 1}"
    gap = put(f"bytes {CHUNK + 10}-{len(body) - 1}/{len(body)}", body[CHUNK + 10:])
    assert gap.status_code == 400
    final = put(f"bytes {CHUNK}-{len(body) - 1}/{len(body)}", body[CHUNK:])
    assert final.status_code == 200 and final.json()["size"] == str(len(body))
    after = put(f"bytes */{len(body)}")  # a status query after completion returns the object
    assert after.status_code == 200 and after.json()["generation"] == final.json()["generation"]
    stored = gcs_client.bucket(gcs_bucket).get_blob("session.bin")
    assert stored.content_type == "application/x-session"
    assert stored.download_as_bytes() == body


def test_media_upload_type_stores_the_request_body(gcs, gcs_client, gcs_bucket):
    body = payload(300)
    response = requests.post(f"{gcs.url}/upload/storage/v1/b/{gcs_bucket}/o",
                             params={"uploadType": "media", "name": "media/one.bin"}, data=body,
                             headers={"Content-Type": "application/x-media"}, timeout=10)
    assert response.status_code == 200
    blob = gcs_client.bucket(gcs_bucket).get_blob("media/one.bin")
    assert blob.generation == int(response.json()["generation"]) and blob.content_type == "application/x-media"
    assert blob.download_as_bytes() == body


def test_corrupted_multipart_checksum_is_rejected(gcs, gcs_bucket):
    boundary = "==boundary=="
    body = (f"--{boundary}\r\ncontent-type: application/json; charset=UTF-8\r\n\r\n"
            '{"name": "bad.bin", "crc32c": "AAAAAA=="}\r\n'
            f"--{boundary}\r\ncontent-type: application/octet-stream\r\n\r\npayload\r\n--{boundary}--").encode()
    response = requests.post(f"{gcs.url}/upload/storage/v1/b/{gcs_bucket}/o", params={"uploadType": "multipart"},
                             data=body, headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
                             timeout=10)
    assert response.status_code == 400
    assert "crc32c" in response.json()["error"]["message"]


def test_ranged_downloads_return_the_requested_slice(gcs_client, gcs_bucket):
    body = payload(5000)
    gcs_client.bucket(gcs_bucket).blob("ranged").upload_from_string(body)
    blob = gcs_client.bucket(gcs_bucket).blob("ranged")
    assert blob.download_as_bytes(start=10, end=19) == body[10:20]  # end is inclusive
    assert blob.download_as_bytes(start=4990) == body[4990:]
    assert blob.download_as_bytes(start=100, end=10**9) == body[100:]  # clamped to the object
    with pytest.raises(exceptions.RequestRangeNotSatisfiable):
        blob.download_as_bytes(start=5000)


def test_blob_reader_uses_ranged_reads(gcs, gcs_client, gcs_bucket):
    body = payload(3 * CHUNK + 7)
    gcs_client.bucket(gcs_bucket).blob("reader").upload_from_string(body)
    gcs.reset_counts()
    with gcs_client.bucket(gcs_bucket).blob("reader").open("rb", chunk_size=CHUNK) as reader:
        assert reader.read(100) == body[:100]
        reader.seek(2 * CHUNK)
        assert reader.read(CHUNK) == body[2 * CHUNK: 3 * CHUNK]
        assert reader.read() == body[3 * CHUNK:]
        assert reader.read(10) == b""
    assert gcs.counts()["reads"] >= 3  # one chunk at a time, never the whole object in one GET


def test_delete_removes_the_object(gcs_client, gcs_bucket):
    blob = gcs_client.bucket(gcs_bucket).blob("doomed")
    blob.upload_from_string(b"x")
    blob.delete()
    assert not gcs_client.bucket(gcs_bucket).blob("doomed").exists()
    with pytest.raises(exceptions.NotFound):
        blob.delete()


def test_patch_merges_metadata_and_bumps_metageneration_only(gcs_client, gcs_bucket):
    blob = gcs_client.bucket(gcs_bucket).blob("patched")
    blob.metadata = {"state": "leased", "owner": "w1"}
    blob.upload_from_string(b"body")
    generation = blob.generation

    blob.metadata = {"state": "done", "owner": None}  # None removes the key, as on GCS
    blob.patch()
    assert (blob.generation, blob.metageneration) == (generation, 2)
    assert blob.metadata == {"state": "done"}
    reread = gcs_client.bucket(gcs_bucket).get_blob("patched")
    assert reread.metadata == {"state": "done"} and reread.metageneration == 2
    assert reread.download_as_bytes() == b"body"


def test_every_write_gets_a_new_generation_and_metageneration_one(gcs_client, gcs_bucket):
    bucket = gcs_client.bucket(gcs_bucket)
    seen = []
    for i in range(5):
        blob = bucket.blob("same" if i % 2 else f"other-{i}")
        blob.upload_from_string(str(i).encode())
        assert blob.metageneration == 1
        seen.append(blob.generation)
    assert seen == sorted(seen) and len(set(seen)) == len(seen)


def _names(client, bucket, **kwargs):
    return [blob.name for blob in client.list_blobs(bucket, **kwargs)]


def test_list_by_prefix_and_delimiter_reports_prefixes(gcs_client, gcs_bucket):
    bucket = gcs_client.bucket(gcs_bucket)
    for name in ("a/1", "a/2", "a/sub/3", "a/sub/4", "a/zz/5", "b/6", "top"):
        bucket.blob(name).upload_from_string(name.encode())
    assert _names(gcs_client, gcs_bucket, prefix="a/") == ["a/1", "a/2", "a/sub/3", "a/sub/4", "a/zz/5"]
    iterator = gcs_client.list_blobs(gcs_bucket, prefix="a/", delimiter="/")
    assert [blob.name for blob in iterator] == ["a/1", "a/2"]
    assert iterator.prefixes == {"a/sub/", "a/zz/"}
    top = gcs_client.list_blobs(gcs_bucket, delimiter="/")
    assert [blob.name for blob in top] == ["top"] and top.prefixes == {"a/", "b/"}


def test_list_paginates_with_max_results_and_page_token(gcs, gcs_client, gcs_bucket):
    bucket = gcs_client.bucket(gcs_bucket)
    names = [f"tasks/{i:04d}" for i in range(23)]
    for name in names:
        bucket.blob(name).upload_from_string(b"t")
    gcs.reset_counts()
    pages = list(gcs_client.list_blobs(gcs_bucket, prefix="tasks/", page_size=10).pages)
    assert [page.num_items for page in pages] == [10, 10, 3]
    assert [blob.name for page in pages for blob in page] == names
    assert gcs.counts()["lists"] == 3
    # prefixes count towards maxResults too, and no group is repeated across pages
    for i in range(4):
        bucket.blob(f"groups/g{i}/x").upload_from_string(b"g")
        bucket.blob(f"groups/item{i}").upload_from_string(b"i")
    iterator = gcs_client.list_blobs(gcs_bucket, prefix="groups/", delimiter="/", page_size=3)
    items = [blob.name for blob in iterator]
    assert items == [f"groups/item{i}" for i in range(4)]
    assert iterator.prefixes == {f"groups/g{i}/" for i in range(4)}


def test_list_start_and_end_offset_bound_the_names(gcs_client, gcs_bucket):
    bucket = gcs_client.bucket(gcs_bucket)
    for i in range(10):
        bucket.blob(f"leases/{i:02d}").upload_from_string(b"l")
    assert _names(gcs_client, gcs_bucket, prefix="leases/", start_offset="leases/07") == [
        "leases/07", "leases/08", "leases/09"]
    assert _names(gcs_client, gcs_bucket, prefix="leases/", start_offset="leases/02", end_offset="leases/04") == [
        "leases/02", "leases/03"]
    assert _names(gcs_client, gcs_bucket, start_offset="leases/05", max_results=2) == ["leases/05", "leases/06"]


def test_listing_items_carry_custom_metadata_and_full_resources(gcs_client, gcs_bucket):
    bucket = gcs_client.bucket(gcs_bucket)
    blob = bucket.blob("with-meta")
    blob.metadata = {"holder": "worker-3", "expires": "2030-01-01T00:00:00Z"}
    blob.upload_from_string(b"lease body")
    bucket.blob("without-meta").upload_from_string(b"x")
    listed = {b.name: b for b in gcs_client.list_blobs(gcs_bucket)}
    assert listed["with-meta"].metadata == {"holder": "worker-3", "expires": "2030-01-01T00:00:00Z"}
    assert listed["with-meta"].generation == blob.generation
    assert listed["with-meta"].size == len(b"lease body") and listed["with-meta"].updated is not None
    assert listed["with-meta"].crc32c == blob.crc32c
    assert listed["without-meta"].metadata is None  # GCS omits the key when there is none


def test_unemulated_listing_features_are_refused(gcs_client, gcs_bucket):
    with pytest.raises(exceptions.BadRequest, match="matchglob"):
        list(gcs_client.list_blobs(gcs_bucket, match_glob="**/*.json"))
