"""Fault injection and request counts, in process and over the HTTP admin endpoints."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from google.api_core import exceptions
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage
from google.cloud.storage.retry import DEFAULT_RETRY

from tests.fakegcs import FakeGCSAdmin, FakeGCSError

# The client's default retry policy (same predicate), with back-off short enough for tests.
FAST_RETRY = DEFAULT_RETRY.with_delay(initial=0.01, multiplier=1.5, maximum=0.05)
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bucket(gcs_client, gcs_bucket):
    return gcs_client.bucket(gcs_bucket)


def test_next_503_fails_a_client_without_retry(gcs, bucket):
    gcs.faults.fail_next(1, 503, kind="write")
    with pytest.raises(exceptions.ServiceUnavailable):
        bucket.blob("x").upload_from_string(b"x", retry=None)
    assert not bucket.blob("x").exists()
    assert gcs.counts()["faults_injected"] == 1


def test_next_503s_are_retried_by_the_default_policy_and_counted(gcs, bucket):
    gcs.faults.fail_next(2, 503, kind="write", name_prefix="jobs/")
    blob = bucket.blob("jobs/1")
    blob.upload_from_string(b"payload", retry=FAST_RETRY)
    assert bucket.blob("jobs/1").download_as_bytes() == b"payload"
    counts = gcs.counts()
    assert counts["writes"] == 3 and counts["faults_injected"] == 2  # two refused attempts, then the write


def test_429_on_reads_raises_too_many_requests(gcs, bucket):
    bucket.blob("hot").upload_from_string(b"hot")
    gcs.faults.fail_next(1, 429, kind="read")
    with pytest.raises(exceptions.TooManyRequests):
        bucket.blob("hot").download_as_bytes(retry=None)
    gcs.faults.fail_next(1, 429, kind="read")
    assert bucket.blob("hot").download_as_bytes(retry=FAST_RETRY) == b"hot"


def test_rules_match_only_their_method_kind_and_name(gcs, bucket):
    gcs.faults.fail_next(5, 503, name_contains="leases/", kind="write")
    bucket.blob("outputs/a").upload_from_string(b"a", retry=None)  # not matched: goes through
    with pytest.raises(exceptions.ServiceUnavailable):
        bucket.blob("leases/a").upload_from_string(b"a", retry=None)
    gcs.faults.reset()
    gcs.faults.fail_next(1, 503, method="DELETE")
    bucket.blob("outputs/a").download_as_bytes(retry=None)
    with pytest.raises(exceptions.ServiceUnavailable):
        bucket.blob("outputs/a").delete(retry=None)
    with pytest.raises(FakeGCSError, match="kind"):
        gcs.faults.fail_next(1, 503, kind="writes")


def test_apply_then_drop_stores_the_write_but_the_client_sees_a_connection_error(gcs, bucket):
    gcs.faults.drop_after_apply(1, name_contains="ambiguous")
    with pytest.raises(requests.exceptions.ConnectionError):
        bucket.blob("ambiguous").upload_from_string(b"landed", retry=None)
    stored = bucket.get_blob("ambiguous")
    assert stored is not None and stored.download_as_bytes() == b"landed"
    assert gcs.counts()["faults_injected"] == 1


def test_retried_create_after_a_dropped_answer_gets_412(gcs, bucket):
    """The ambiguous create: our own write landed, the retry then finds it and is refused."""
    gcs.faults.drop_after_apply(1, name_contains="claims/")
    with pytest.raises(exceptions.PreconditionFailed):
        bucket.blob("claims/t1").upload_from_string(b"mine", if_generation_match=0, retry=FAST_RETRY)
    assert bucket.blob("claims/t1").download_as_bytes() == b"mine"
    assert gcs.counts()["writes"] == 2


def test_retried_delete_after_a_dropped_answer_gets_404(gcs, bucket):
    blob = bucket.blob("gone")
    blob.upload_from_string(b"x")
    gcs.faults.drop_after_apply(1, kind="delete")
    with pytest.raises(exceptions.NotFound):
        blob.delete(retry=FAST_RETRY)
    assert gcs.counts()["deletes"] == 2


def test_random_fraction_of_failures_is_absorbed_by_retries(gcs, bucket):
    bucket.blob("chaos").upload_from_string(b"c")
    gcs.reset_counts()
    gcs.faults.fail_fraction(0.3, 503, seed=7, kind="read")
    for _ in range(30):
        assert bucket.blob("chaos").download_as_bytes(retry=FAST_RETRY) == b"c"
    counts = gcs.counts()
    assert counts["faults_injected"] > 0
    assert counts["reads"] == 30 + counts["faults_injected"]
    gcs.faults.reset()
    gcs.faults.fail_fraction(1.0, 503, kind="list")
    with pytest.raises(exceptions.ServiceUnavailable):
        list(bucket.list_blobs(retry=None))


def test_latency_delays_only_the_chosen_kind(gcs, bucket):
    bucket.blob("slow").upload_from_string(b"s")
    gcs.faults.add_latency(0.4, kind="read")
    started = time.monotonic()
    bucket.blob("slow").download_as_bytes()
    read_seconds = time.monotonic() - started
    started = time.monotonic()
    bucket.blob("fast").upload_from_string(b"f")
    write_seconds = time.monotonic() - started
    assert read_seconds >= 0.4 and write_seconds < read_seconds
    gcs.faults.reset()
    started = time.monotonic()
    bucket.blob("slow").download_as_bytes()
    assert time.monotonic() - started < read_seconds


def test_counts_are_kept_per_kind(gcs, bucket):
    bucket.blob("a").upload_from_string(b"a")  # multipart: one write
    bucket.blob("a").download_as_bytes()
    bucket.get_blob("a")
    list(bucket.list_blobs())
    bucket.blob("a").delete()
    assert gcs.counts() == {"writes": 1, "reads": 2, "lists": 1, "deletes": 1, "faults_injected": 0}
    gcs.reset_counts()
    assert set(gcs.counts().values()) == {0}


def test_admin_endpoints_drive_faults_and_counts_over_http(gcs, bucket):
    admin = FakeGCSAdmin(gcs.url)
    admin.faults.fail_next(1, 503, kind="write")
    with pytest.raises(exceptions.ServiceUnavailable):
        bucket.blob("remote").upload_from_string(b"r", retry=None)
    admin.faults.drop_after_apply(1, kind="write")
    with pytest.raises(requests.exceptions.ConnectionError):
        bucket.blob("remote").upload_from_string(b"r", retry=None)
    assert admin.counts() == gcs.counts() and admin.counts()["faults_injected"] == 2
    admin.faults.add_latency(0.0)
    admin.faults.fail_fraction(1.0, 429, seed=1, kind="read")
    with pytest.raises(exceptions.TooManyRequests):
        bucket.blob("remote").download_as_bytes(retry=None)
    admin.faults.reset()
    assert bucket.blob("remote").download_as_bytes(retry=None) == b"r"
    admin.reset_counts()
    assert set(gcs.counts().values()) == {0}
    with pytest.raises(FakeGCSError, match="400"):
        admin.faults.fail_next(1, 200)


def test_concurrent_clients_see_no_errors_and_unique_generations(gcs, gcs_client, gcs_bucket):
    bucket = gcs_client.bucket(gcs_bucket)

    def worker(index: int) -> list[int]:
        generations = []
        for step in range(15):
            blob = bucket.blob(f"w{index}/{step}")
            blob.upload_from_string(b"x", if_generation_match=0)
            generations.append(blob.generation)
            assert bucket.blob(f"w{index}/{step}").download_as_bytes() == b"x"
        assert len(list(bucket.list_blobs(prefix=f"w{index}/"))) == 15
        return generations

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        generations = [g for result in pool.map(worker, range(16)) for g in result]
    assert len(set(generations)) == len(generations) == 16 * 15
    assert gcs.counts()["writes"] == 16 * 15


def test_standalone_server_prints_its_url_and_stops_on_sigterm():
    process = subprocess.Popen([sys.executable, "-m", "tests.fakegcs", "--port", "0", "--print-url",
                                "--bucket", "standalone-bucket"], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        client = storage.Client(project="p", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": url})
        blob = client.bucket("standalone-bucket").blob("hello")
        blob.upload_from_string(b"from another process", if_generation_match=0)
        admin = FakeGCSAdmin(url)
        admin.faults.fail_next(1, 503, kind="read")
        with pytest.raises(exceptions.ServiceUnavailable):
            client.bucket("standalone-bucket").blob("hello").download_as_bytes(retry=None)
        assert admin.counts()["writes"] == 1 and admin.counts()["reads"] == 1
        client.close()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
        process.stdout.close()
