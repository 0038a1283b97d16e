"""fleet.keeper, and the keeper `gcs-spawner keep` builds (gcs_spawner/keep.py), against the fake TPU API: a preempted spot TPU (its queued
resource SUSPENDED) is deleted and replaced while claimable work outnumbers the idle machines, never
in a tail held by others; a refusing zone falls back to the next, and a drained queue stops the keeper."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet import keeper, specs, tpu
from objectstore import open_store
from taskqueue.claims import ClaimOptions, Claimer
from taskqueue.submit import submit
from tests.cloud.fakecloud import FakeCloud

REPO = Path(__file__).resolve().parents[2]
TPU_SPEC = REPO / "templates" / "tpu.yaml"
PROJECT = "proj-k"
ZONE_A, ZONE_B = "us-west4-a", "us-east5-b"


def _qr(zone: str, rid: str) -> str:
    return f"projects/{PROJECT}/locations/{zone}/queuedResources/{rid}"


def _keeper(tpu_clients, count: int, work: list[keeper.Work], zones=(ZONE_A, ZONE_B)) -> keeper.Keeper:
    """A keeper whose queue holds `work[0]` (a test changes it between steps)."""
    spec = specs.load_spec(TPU_SPEC)
    launch = specs.Launch.make(spec, "gs://bkt/jobs/j", "gs://bkt/code/c")
    return keeper.Keeper(tpu_clients, spec, launch, PROJECT, list(zones), count, lambda: work[0])


def _free(claimable: int) -> list[keeper.Work]:
    return [keeper.Work(claimable=claimable, held=0, complete=False)]


def _running_fleet(cloud: FakeCloud, tpu_clients, count: int, *preempted: str) -> tuple[keeper.Keeper, list[keeper.Work], keeper.StepReport]:
    """A keeper that has launched `count` machines for plenty of work, then seen `preempted` ones SUSPENDED."""
    work = _free(10)
    fleet_keeper = _keeper(tpu_clients, count, work)
    first = fleet_keeper.step()
    for rid in preempted:
        cloud.set_queued_resource_state(_qr(ZONE_A, rid), "SUSPENDED")
    return fleet_keeper, work, first


def test_keeper_replaces_a_suspended_tpu_while_work_is_pending(cloud: FakeCloud, tpu_clients):
    fleet_keeper = _keeper(tpu_clients, 2, _free(10))
    first = fleet_keeper.step()
    assert first.created == [f"{ZONE_A}/spawn-tpu-0000", f"{ZONE_A}/spawn-tpu-0001"]
    assert fleet_keeper.step().created == []  # both ACTIVE: nothing to do

    cloud.set_queued_resource_state(_qr(ZONE_A, "spawn-tpu-0000"), "SUSPENDED")  # preempted
    report = fleet_keeper.step()
    assert report.deleted == ["spawn-tpu-0000"]
    assert report.created == [f"{ZONE_A}/spawn-tpu-0002"]
    assert _qr(ZONE_A, "spawn-tpu-0000") not in cloud.resources
    deletes = [c for c in cloud.calls("DELETE")]
    assert [(c.path, c.query.get("force")) for c in deletes] == [(f"/v2/{_qr(ZONE_A, 'spawn-tpu-0000')}", "true")]
    created = cloud.resources[_qr(ZONE_A, "spawn-tpu-0002")]
    node = created["tpu"]["nodeSpec"][0]
    assert node["nodeId"] == "spawn-tpu-0002" and node["node"]["metadata"]["spawn-queued-resource"] == "spawn-tpu-0002"
    assert "spot" in created


def test_keeper_falls_back_to_the_next_zone_when_one_refuses(cloud: FakeCloud, tpu_clients):
    cloud.fail_next(1, 429, method="POST", path_contains=f"locations/{ZONE_A}/queuedResources")
    report = _keeper(tpu_clients, 1, _free(3)).step()
    assert report.created == [f"{ZONE_B}/spawn-tpu-0000"]
    assert len(report.refused) == 1 and report.refused[0].startswith(f"{ZONE_A}: ")
    assert _qr(ZONE_B, "spawn-tpu-0000") in cloud.resources


def test_keeper_moves_away_from_a_zone_whose_resource_failed(cloud: FakeCloud, tpu_clients):
    fleet_keeper = _keeper(tpu_clients, 1, _free(5))
    fleet_keeper.step()
    cloud.set_queued_resource_state(_qr(ZONE_A, "spawn-tpu-0000"), "FAILED")
    report = fleet_keeper.step()
    assert report.deleted == ["spawn-tpu-0000"] and report.created == [f"{ZONE_B}/spawn-tpu-0001"]


def test_keeper_stops_when_the_queue_is_drained_and_creates_nothing(cloud: FakeCloud, tpu_clients):
    fleet_keeper, work, _ = _running_fleet(cloud, tpu_clients, 2, "spawn-tpu-0001")
    work[0] = keeper.Work(claimable=0, held=0, complete=True)
    before = len(cloud.calls())
    report = fleet_keeper.run(interval_s=0, max_steps=5)
    assert report.drained and report.created == [] and report.deleted == []
    assert len(cloud.calls()) == before  # not even a listing


def test_a_dry_keep_prints_the_replacement_and_sends_nothing(cloud: FakeCloud, tpu_clients, gcs_bucket: str, gcs_client,
                                                             capsys):
    queue = f"gs://{gcs_bucket}/jobs/j"
    submit(open_store(queue), None, [("t1", json.dumps({"id": "t1"}).encode())])
    fleet_keeper = _keeper(tpu_clients, 1, _free(1))
    fleet_keeper.step()
    cloud.set_queued_resource_state(_qr(ZONE_A, "spawn-tpu-0000"), "SUSPENDED")
    mutations = len(cloud.mutations())
    report = _dry_keeper(tpu_clients, queue, 1, [ZONE_A]).step()
    out = capsys.readouterr().out
    assert len(cloud.mutations()) == mutations
    assert "would send DeleteQueuedResourceRequest" in out
    assert "would send CreateQueuedResourceRequest" in out and "spawn-tpu-0001" in out
    assert (report.work.claimable, report.work.held, len(report.alive), report.deleted, len(report.created)) == (
        1, 0, 0, ["spawn-tpu-0000"], 1)


def _dry_keeper(tpu_clients, queue: str, count: int, zones: list[str]) -> keeper.Keeper:
    """The keeper `gcs-spawner keep --dry-run` builds: its work read from the queue through reporting.status."""
    from gcs_spawner.keep import queue_work

    spec = specs.load_spec(TPU_SPEC)
    return keeper.Keeper(tpu_clients, spec, specs.Launch.make(spec, queue, "gs://bkt/code/c"), PROJECT, zones, count,
                         queue_work(open_store(queue)), dry_run=True)


def test_keeper_refuses_plain_node_specs(tmp_path: Path):
    spec = specs.parse_spec({**__import__("yaml").safe_load(TPU_SPEC.read_text()), "queued": False}, "x.yaml")
    with pytest.raises(keeper.KeeperError, match="queued: false"):
        keeper.Keeper(None, spec, specs.Launch.make(spec, "gs://bkt/q", "gs://bkt/c"), PROJECT, [ZONE_A], 1, lambda: 1)


def test_keeper_creates_nothing_in_a_tail_held_by_others(cloud: FakeCloud, tpu_clients):
    """The last tasks are held by live machines and nothing is claimable: a preempted machine is
    cleaned up but not replaced, since its replacement could only boot, idle out and delete itself."""
    fleet_keeper, work, first = _running_fleet(cloud, tpu_clients, 4, "spawn-tpu-0000", "spawn-tpu-0001")
    assert len(first.created) == 4
    work[0] = keeper.Work(claimable=0, held=2, complete=False)  # the two survivors hold the last two tasks
    report = fleet_keeper.step()
    assert report.deleted == ["spawn-tpu-0000", "spawn-tpu-0001"] and report.created == []
    assert len(report.alive) == 2
    assert not [c for c in cloud.calls("POST") if "spawn-tpu-0004" in c.query.get("queuedResourceId", "")]


def test_keeper_replaces_only_for_work_the_idle_machines_cannot_take(cloud: FakeCloud, tpu_clients):
    fleet_keeper, work, _ = _running_fleet(cloud, tpu_clients, 4, "spawn-tpu-0000")
    # 3 alive, 2 of them holding a task (1 idle); 3 claimable: the idle one takes 1, 2 more are needed,
    # but only 1 fits under --count.
    work[0] = keeper.Work(claimable=3, held=2, complete=False)
    assert fleet_keeper.step().created == [f"{ZONE_A}/spawn-tpu-0004"]
    # 4 alive, 3 holding, 1 idle, 1 claimable: the idle machine takes it.
    cloud.set_queued_resource_state(_qr(ZONE_A, "spawn-tpu-0001"), "SUSPENDED")
    work[0] = keeper.Work(claimable=1, held=2, complete=False)
    report = fleet_keeper.step()
    assert report.deleted == ["spawn-tpu-0001"] and report.created == []


@pytest.mark.parametrize(
    "count, alive, claimable, held, wanted",
    [(4, 0, 10, 0, 4), (4, 2, 10, 2, 2), (4, 2, 0, 2, 0), (4, 2, 1, 2, 1), (4, 3, 1, 2, 0), (4, 4, 9, 4, 0), (4, 1, 0, 5, 0)],
)
def test_replacements_cover_claimable_work_beyond_idle_machines(count, alive, claimable, held, wanted):
    assert keeper.replacements(count, alive, keeper.Work(claimable=claimable, held=held, complete=False)) == wanted


def test_keeper_in_a_simulated_tail_launches_only_while_claimable_work_waits(cloud: FakeCloud, tpu_clients, capsys):
    """Ten tasks of three keeper intervals each, at most four machines, a preemption of a working
    machine mid-job (interval 2) and in the tail (interval 6). Each interval: the keeper steps, then
    every alive machine without a task claims one, tasks progress, and a machine that found nothing
    to claim for two intervals deletes itself (spawn.py --on-empty delete). A preempted machine's
    task becomes claimable again (its lease released, or expired)."""
    tasks_left, duration, idle_limit = 10, 3, 2
    running: dict[str, int] = {}  # queued resource -> intervals left on its task
    idle: dict[str, int] = {}  # queued resource -> intervals it found nothing to claim
    work = [keeper.Work(claimable=tasks_left, held=0, complete=False)]
    fleet_keeper = _keeper(tpu_clients, 4, work, zones=(ZONE_A,))
    timeline = []
    for interval in range(30):
        if interval in (2, 6) and running:
            victim = sorted(running)[0]
            cloud.set_queued_resource_state(_qr(ZONE_A, victim), "SUSPENDED")
            del running[victim]
            tasks_left += 1
        work[0] = keeper.Work(claimable=tasks_left, held=len(running), complete=not tasks_left and not running)
        report = fleet_keeper.step()
        created = [c.rsplit("/", 1)[1] for c in report.created]
        timeline.append((interval, work[0], len(report.alive), created))
        if report.drained:
            break
        for rid in sorted(report.alive) + created:
            if rid in running:
                continue
            if tasks_left:
                running[rid], tasks_left = duration, tasks_left - 1
                idle.pop(rid, None)
            else:
                idle[rid] = idle.get(rid, 0) + 1
                if idle[rid] >= idle_limit:  # idled out: the machine deletes its own queued resource
                    tpu_clients.send(tpu.delete_queued_resource(_qr(ZONE_A, rid)))
        for rid in list(running):
            running[rid] -= 1
            if running[rid] == 0:
                del running[rid]
    with capsys.disabled():
        print("\ninterval claimable held alive created")
        for interval, seen, alive, created in timeline:
            print(f"{interval:8d} {seen.claimable:9d} {seen.held:4d} {alive:5d} {','.join(created) or '-'}")
    assert timeline[-1][1] == keeper.Work(0, 0, complete=True)  # drained
    # Every creation answered claimable work beyond the idle machines; none came once nothing was claimable.
    for _, seen, alive, created in timeline:
        if created:
            assert seen.claimable > max(0, alive - seen.held)
    # The mid-job preemption is replaced; the tail one is not: at interval 6 the three idle machines
    # take the three claimable tasks (the preempted one's among them), and from then on nothing is
    # claimable, so the fleet shrinks to zero as its machines idle out.
    assert [(i, c) for i, _, _, cs in timeline for c in cs] == [
        (0, "spawn-tpu-0000"), (0, "spawn-tpu-0001"), (0, "spawn-tpu-0002"), (0, "spawn-tpu-0003"), (2, "spawn-tpu-0004"),
    ]
    assert [alive for _, _, alive, _ in timeline][-4:] == [3, 3, 3, 0]


def test_keep_reads_tasks_held_by_others_as_not_claimable(cloud: FakeCloud, tpu_clients, gcs_bucket: str, gcs_client,
                                                          capsys):
    """`gcs-spawner keep` counts the queue through reporting.status: two tasks under live leases of another
    worker are held, not claimable, so a preempted machine is deleted and not replaced."""
    queue = f"gs://{gcs_bucket}/jobs/tail"
    store = open_store(queue)
    submit(store, None, [(t, json.dumps({"id": t}).encode()) for t in ("t1", "t2")])
    claimer = iter(Claimer(store, ClaimOptions(worker="other-machine", lease_ttl_s=600, idle_timeout_s=1, poll_min_s=0.01,
                                               poll_max_s=0.05)))
    assert {next(claimer).task_id, next(claimer).task_id} == {"t1", "t2"}
    fleet_keeper = _keeper(tpu_clients, 2, _free(2))
    fleet_keeper.step()
    cloud.set_queued_resource_state(_qr(ZONE_A, "spawn-tpu-0000"), "SUSPENDED")
    report = _dry_keeper(tpu_clients, queue, 2, [ZONE_A, ZONE_B]).step()
    assert (report.work.claimable, report.work.held, len(report.alive), len(report.deleted), report.created) == (
        0, 2, 1, 1, [])
    assert "CreateQueuedResourceRequest" not in capsys.readouterr().out


def test_zones_are_accepted_comma_separated_or_repeated():
    from gcs_spawner.cli import zone_list

    assert zone_list(["us-west4-a,us-east5-b", "us-central2-b", "us-west4-a"]) == [
        "us-west4-a", "us-east5-b", "us-central2-b"]


def test_keeper_goes_on_while_a_batch_is_being_submitted_and_stops_on_statuss_complete(cloud: FakeCloud, tpu_clients,
                                                                                       gcs_bucket: str, gcs_client):
    """Nothing claimable and nothing held is not the end while a submit is under way (its batch
    marker `running`, its tasks not created yet): status says complete False, so the keeper keeps
    watching (it used to stop at `claimable=0 held=0`). Once the batch is finished and its task
    done, status's complete stops it: one rule (taskqueue/completion.py) for both."""
    from gcs_spawner.keep import queue_work  # what `gcs-spawner keep` gives the keeper
    from reporting.status import snapshot
    from taskqueue.submit import batch_name, begin_batch

    queue = f"gs://{gcs_bucket}/jobs/late"
    store = open_store(queue)
    submit(store, b"{}", [("t1", json.dumps({"id": "t1"}).encode())])
    options = ClaimOptions(worker="w", lease_ttl_s=60, idle_timeout_s=0.2, poll_min_s=0.01, poll_max_s=0.05)
    for claim in Claimer(store, options):
        claim.lease.complete([], 0.0)
    name = batch_name(["t2"])
    begin_batch(store, name, {"first": "t2", "last": "t2", "tasks": "1"})  # a submit that has begun, no task yet
    view = snapshot(store)
    assert (view["pending"], view["leased"], view["complete"]) == (0, 0, False)

    fleet_keeper = keeper.Keeper(tpu_clients, specs.load_spec(TPU_SPEC), specs.Launch.make(specs.load_spec(TPU_SPEC), queue, "gs://bkt/code/c"),
                                 PROJECT, [ZONE_A], 2, queue_work(store))  # fmt: skip
    report = fleet_keeper.run(interval_s=0, max_steps=3)
    assert not report.drained and report.work == keeper.Work(claimable=0, held=0, complete=False)
    assert len(cloud.calls("GET", "/queuedResources")) == 3  # it went on looking, step after step

    submit(store, None, [("t2", json.dumps({"id": "t2"}).encode())])  # the submit finishes its batch
    assert fleet_keeper.step().work.claimable == 1  # and its task is claimable: no stop
    for claim in Claimer(store, options):
        claim.lease.complete([], 0.0)
    report = fleet_keeper.run(interval_s=0, max_steps=3)
    assert report.drained and report.work == keeper.Work(claimable=0, held=0, complete=True)
