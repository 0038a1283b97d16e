"""The first boot, rehearsed (tests/boot/rehearsal.py): a stock Debian machine with no network but the
fake Google APIs boots the real startup.sh from its metadata and, from the bucket alone (code, uv, the
interpreter, the wheels, all put there by the real tools/upload_code.py through the real gcloud),
claims a task, extracts it with a tiny model, writes the done marker and leaves its group; a machine
whose wheelhouse is broken records why and leaves its group too. Then the ways a boot or a worker can
end that a first real fleet would meet, each ending in a reason and a delete: gcloud arriving late as
a snap with a typo in the queue prefix, a queue bucket that does not exist, a worker that keeps failing.

Needs a Debian host, root with the right to make namespaces (a container without CAP_SYS_ADMIN has
not), mmdebstrap, iproute2 and gcloud (`make rehearsal-tools`); elsewhere it skips saying what is
missing, except in CI (.ci/run sets BOOT_REHEARSAL=required; so does a CI variable), where a
missing piece fails it."""

from __future__ import annotations

import json
import threading

import pytest

from tests.boot.rehearsal import (BUCKET, GROUP, PROJECT, ZONE, LateGcloud, Rehearsal, first_claim_time, release_host,
                                  report, skip_or_fail_without_the_tools, standin_release)
from tests.fakegcs.server import Preconditions

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture
def world(tmp_path) -> Rehearsal:
    """One machine world (namespaces, fakes, the upload) for the one test below: pytest-xdist may hand
    tests of a module to different workers, so the costly set-up is never shared between tests."""
    skip_or_fail_without_the_tools()
    with Rehearsal(tmp_path, disks=2) as rehearsal:
        release, listing = standin_release(rehearsal.lower)
        url, stop = release_host(release)
        try:
            rehearsal.upload_code("code/run1", url, listing)
        finally:
            stop()
        yield rehearsal


def _record(world: Rehearsal, job: str, name: str) -> tuple[dict, dict]:
    [stored] = world.objects(f"jobs/{job}/machines/{name}.json").values()
    return json.loads(stored.data), dict(stored.metadata)


def test_a_stock_machine_boots_from_the_bucket_alone_and_a_broken_wheelhouse_ends_failed_never_idle(
        world: Rehearsal, monkeypatch: pytest.MonkeyPatch):
    _stock_image_has_nothing_the_boot_could_lean_on(world)
    _boots_from_the_bucket_alone_claims_extracts_and_leaves_its_group(world, monkeypatch)
    _broken_wheelhouse_ends_in_a_failed_record_with_its_log_tail_and_a_delete(world)
    # Every way a boot or a worker can end says why (issue 36), on the same disks: reboots, warm.
    _late_snap_gcloud_is_waited_for_and_a_typo_in_the_queue_prefix_ends_failed_naming_it(world)
    _a_queue_bucket_that_does_not_exist_ends_the_boot_before_the_install(world)
    _a_worker_that_keeps_failing_ends_in_a_record_and_a_delete_not_a_loop(world)


def _boots_from_the_bucket_alone_claims_extracts_and_leaves_its_group(world: Rehearsal,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from activations.reader import open_activations

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", world.uploader.url)  # the activations, read back from here
    [task] = world.submit_job("j1")
    world.set_machine("spawn-worker-0001", "code/run1", "j1")
    boot = world.boot(world.disks[0], "first boot")
    console = boot.console
    assert boot.status == 0, console[-6000:]
    delete = world.wait_for_delete("spawn-worker-0001", timeout=600)
    log = world.worker_log(world.disks[0])
    assert delete is not None, f"no deleteInstances request; worker log:\n{log[-6000:]}\nconsole:\n{console[-3000:]}"

    # 1-2: metadata read, booting and installing recorded (through the real gcloud storage cp).
    for state in ("booting", "installing"):
        assert f"event=machine_record machine=spawn-worker-0001 state={state}" in console
    # 3: the code came through the real gcloud from the bucket (no stub anywhere on PATH).
    assert "event=code_sync source=gs://rehearsal-bucket/code/run1" in console
    # 4: uv/uv from the bucket; the interpreter from the bucket's mirror; never apt or python3 -m venv.
    assert "event=uv source=bucket version=" in console and "source=pip" not in console
    assert "event=apt_install" not in console and "Installed Python 3.11" in console
    # 5: the lock, from the wheelhouse, with no index.
    assert "event=installed python=3.11 accelerator=cpu" in console
    # 6: spawn.py claimed the task, consume.py extracted it with the tiny model, the done marker is there.
    assert world.objects(f"jobs/j1/done/{task}.json"), f"no done marker; worker log:\n{log[-6000:]}"
    acts = open_activations(f"gs://{BUCKET}/jobs/j1/done/{task}.json")
    assert acts.num_samples == 8 and sorted(acts.layers) == [1, 2] and acts.layer(2).shape == (acts.num_tokens, 32)
    # 7: the last word: the record says deleting, and the group got deleteInstances for this VM alone.
    record, listed = _record(world, "j1", "spawn-worker-0001")
    assert record["state"] == "deleting" and {"booting", "installing"} <= set(record["spent"]), record
    assert (record["machine_type"], record["provisioning"]) == ("g2-standard-8", "spot")
    assert listed["state"] == "deleting"
    assert delete.path == f"/compute/v1/projects/{PROJECT}/zones/{ZONE}/instanceGroupManagers/{GROUP}/deleteInstances"
    assert delete.body == {"instances": [f"zones/{ZONE}/instances/spawn-worker-0001"]}

    # Firewalled for real: the machine's uv cannot reach its default package index.
    probe = world.ns.run(world.disks[0], ["/opt/fleet/code/uv/uv", "pip", "install", "--dry-run", "--python",
                                          "/opt/fleet/venv/bin/python", "--no-cache", "six"],
                         world.machine_env(), timeout=120)
    assert probe.returncode != 0, probe.stdout + probe.stderr

    boot.marks["first_claim"] = first_claim_time(world, world.disks[0])
    print(report(boot))


def _broken_wheelhouse_ends_in_a_failed_record_with_its_log_tail_and_a_delete(world: Rehearsal) -> None:
    """The same code with a wheelhouse that lacks its large wheels (jaxlib among them), as an upload cut
    short would leave it: the locked install cannot finish offline."""
    storage = world.gcs.storage
    for name, stored in world.objects("code/run1/").items():
        relative = name.removeprefix("code/run1/")
        if relative.startswith("wheelhouse/cpu/") and len(stored.data) > 1 << 20:
            continue
        storage.commit(BUCKET, f"code/broken/{relative}", stored.data, {"metadata": dict(stored.metadata)},
                       Preconditions(), stored.content_type)
    world.set_machine("spawn-worker-0002", "code/broken", "j1")
    boot = world.boot(world.disks[1], "broken wheelhouse")
    assert boot.status == 1, boot.console[-6000:]
    record, listed = _record(world, "j1", "spawn-worker-0002")
    assert (record["state"], record["phase"]) == ("failed", "install"), record
    assert record["reason"].startswith("install_failed: exit ")
    assert "No solution found when resolving dependencies" in record["log_tail"] and listed["state"] == "failed"
    assert "event=gave_up attempts=4" in record["log_tail"]
    assert world.wait_for_delete("spawn-worker-0002", timeout=60) is not None
    # Never an idle machine: no worker was started.
    assert not (world.ns.view(world.disks[1]) / "etc/systemd/system/spawn-worker.service").exists()


def _stock_image_has_nothing_the_boot_could_lean_on(world: Rehearsal) -> None:
    """The stock image: no uv, no python3-venv (ensurepip), no virtualenv of ours before the boot."""
    lower = world.lower
    assert not list(lower.glob("usr/bin/uv*")) and not (lower / "opt/fleet").exists()
    assert not list(lower.glob("usr/lib/python3*/ensurepip/__init__.py"))
    assert (lower / "usr/bin/curl").exists() and list(lower.glob("usr/bin/python3.*"))


def _late_snap_gcloud_is_waited_for_and_a_typo_in_the_queue_prefix_ends_failed_naming_it(world: Rehearsal) -> None:
    """gcloud seeded as a snap 15 s into the boot (the race of GoogleCloudPlatform/guest-agent#84: the
    boot used to give up without a record), and spawn-queue pointing at jobs/j1x, where no job is:
    the boot waits for the seeding and goes on; the worker waits --job-wait for a job, then records
    `failed` naming the URL, writes nothing else there, and the machine leaves its group."""
    disk = world.disks[0]
    late = LateGcloud(world.ns.view(disk))
    world.set_machine("spawn-worker-0003", "code/run1", "j1", queue=f"gs://{BUCKET}/jobs/j1x", spawn_flags=["--job-wait", "5"])
    before = len(world.worker_log(disk))  # the disk's log goes on from its earlier boots
    seeding = threading.Timer(15, late.seed)
    seeding.start()
    try:
        boot = world.boot(disk, "late gcloud, typo in the prefix")
    finally:
        seeding.cancel()
        seeding.join()
    late.restore()
    assert boot.status == 0, boot.console[-6000:]
    assert boot.marks["booting"] - boot.marks["startup_script_start"] >= 14, boot.console[-3000:]
    assert "event=snap_seed_wait timeout_s=600" in boot.console and "event=gcloud path=/snap/bin/gcloud" in boot.console
    delete = world.wait_for_delete("spawn-worker-0003", timeout=180)
    log = world.worker_log(disk)[before:]
    assert delete is not None, f"no deleteInstances; worker log:\n{log[-4000:]}"
    record, listed = _record(world, "j1x", "spawn-worker-0003")
    assert record["state"] == "failed" and listed["state"] == "failed", record
    assert record["reason"].startswith(f"no job at gs://{BUCKET}/jobs/j1x: check the queue URL"), record
    assert {"booting"} <= set(record["spent"]) and "reason=drained" not in log and "queue drained" not in log
    assert list(world.objects("jobs/j1x/")) == ["jobs/j1x/machines/spawn-worker-0003.json"]  # no queue object
    assert "event=service_exited unit=spawn-worker.service status=65" in log and "event=service_restart" not in log


def _a_queue_bucket_that_does_not_exist_ends_the_boot_before_the_install(world: Rehearsal) -> None:
    """A typo in spawn-queue's bucket: the booting record cannot land, the JSON API says the bucket is
    not there, and the machine leaves before the sync, the install or a worker (it used to go on, start
    the worker and crash-loop on a NotFound traceback with no record)."""
    disk = world.disks[1]
    world.set_machine("spawn-worker-0004", "code/run1", "j1", queue=f"gs://{BUCKET}-typo/jobs/j1")
    boot = world.boot(disk, "queue bucket missing")
    assert boot.status == 1, boot.console[-6000:]
    assert (f"event=boot_failed phase=queue reason=queue_bucket_missing: bucket gs://{BUCKET}-typo of "
            f"spawn-queue=gs://{BUCKET}-typo/jobs/j1 does not exist (check the queue URL)") in boot.console
    assert "event=code_sync" not in boot.console and "event=installed" not in boot.console
    assert world.wait_for_delete("spawn-worker-0004", timeout=60) is not None
    assert not (world.ns.view(disk) / "etc/systemd/system/spawn-worker.service").exists()


def _a_worker_that_keeps_failing_ends_in_a_record_and_a_delete_not_a_loop(world: Rehearsal) -> None:
    """A worker that fails at every start (no spawn-consumer attribute: fleet.service refuses), under
    the unit's Restart=on-failure (the systemctl stand-in restarts it, 1 s apart): the fifth failure's
    ExecStopPost records `failed` with the reason, disables the unit and deletes the machine."""
    disk = world.disks[0]
    world.set_machine("spawn-worker-0005", "code/run1", "j1", drop=("spawn-consumer",))
    before = len(world.worker_log(disk))
    boot = world.boot(disk, "worker crash loop")
    assert boot.status == 0, boot.console[-6000:]
    delete = world.wait_for_delete("spawn-worker-0005", timeout=300)
    log = world.worker_log(disk)[before:]
    assert delete is not None, f"no deleteInstances; worker log:\n{log[-6000:]}"
    record, listed = _record(world, "j1", "spawn-worker-0005")
    assert (record["state"], listed["state"]) == ("failed", "failed")
    assert record["reason"].startswith("worker_crash_loop: 5 failures in 900s, last exit-code exited=1"), record
    exits = [line for line in log.splitlines() if "event=service_exited" in line]
    assert "'spawn-consumer' is not set" in log and "event=start_limit_hit" not in log
    assert len(exits) == 5 and all(" status=1 " in line for line in exits), exits
