"""The keeper: keeps up to N spot TPU VMs (queued resources) alive while the queue has claimable work.

A preempted spot TPU cannot restart: its queued resource is left SUSPENDED (or FAILED when the
capacity never came), and nothing replaces it (https://cloud.google.com/tpu/docs/queued-resources,
https://cloud.google.com/tpu/docs/spot). Each `step()`:

1. asks `work()` what is left: `claimable` tasks (no live lease: never claimed, released, or whose
   holder went silent past its TTL), `held` ones (a live lease), and whether the queue is
   `complete` by the completion rule that status reads (taskqueue/completion.py: every task
   finished, nothing submitting, `batches/` steady). Only `complete` stops the keeper (the
   machines delete themselves): nothing claimable and nothing held is not the end while a batch
   is still being submitted. The fleet package never imports the queue: the tool gives `work()`;
2. lists the queued resources named `<spec.name>-NNNN` in every zone of `zones`;
3. deletes the SUSPENDED and FAILED ones (with force, taking any node along);
4. creates replacements, but only for work that the alive machines cannot take: a machine that
   holds no lease (booting, or idle) will claim one claimable task, so the keeper adds
   `min(count - alive, claimable - max(0, alive - held))` machines. In the tail, when the last
   tasks are held by others and nothing is claimable, it creates nothing, so a replacement never
   boots only to idle out and delete itself. Replacements get fresh names (a name being deleted
   cannot be reused yet), in the first zone that accepts the request, falling back through `zones`
   when a zone refuses (no capacity, no quota) and preferring zones where nothing just failed.

`held` counts every live lease, including those of machines the keeper does not manage (another
group on the same queue): the keeper then thinks fewer of its own machines are idle and may add
more than needed, never fewer, and never more than `count`.

It holds no state between steps that the TPU API does not hold, so it can run anywhere (a laptop,
a small VM), be stopped and be started again. With `dry_run` it prints what it would send.

`before_create(zone, queued_resource_id)`, when given, runs before each create request is sent: `gcs-spawner`
records there what it is about to make (write-ahead), so that `down` deletes every queued resource the keeper
may have made, even one whose create was interrupted before its answer came.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Sequence

import proto
from google.cloud import tpu_v2

from exitcodes import EX_FAILED
from fleet import gapi, specs, tpu

log = logging.getLogger(__name__)

#: States after which a queued resource never runs its node again.
DEAD = ("SUSPENDED", "FAILED")
#: States that will be, or are, a working TPU VM.
ALIVE = ("CREATING", "ACCEPTED", "PROVISIONING", "WAITING_FOR_RESOURCES", "ACTIVE")


class KeeperError(Exception):
    """The keeper cannot do its job (bad settings, an API that keeps failing); the message says which."""

    exit_code = EX_FAILED  # what a command that ends on it exits with (gcs_spawner/cli.py)


@dataclasses.dataclass(frozen=True)
class Work:
    """What the queue has left: tasks a machine could claim now, tasks under a live lease, and
    whether the queue is complete (taskqueue.completion's rule, as `work()` read it)."""

    claimable: int
    held: int
    complete: bool

    @property
    def remaining(self) -> int:
        return self.claimable + self.held


@dataclasses.dataclass
class StepReport:
    work: Work
    alive: list[str] = dataclasses.field(default_factory=list)
    deleted: list[str] = dataclasses.field(default_factory=list)
    created: list[str] = dataclasses.field(default_factory=list)
    refused: list[str] = dataclasses.field(default_factory=list)  # "zone: error" for zones that refused a create

    @property
    def pending(self) -> int:
        return self.work.remaining

    @property
    def drained(self) -> bool:
        """The queue is complete: the keeper stops (never on counts alone, which miss a submit under way)."""
        return self.work.complete


def replacements(count: int, alive: int, work: Work) -> int:
    """Machines to create: enough for the claimable work that the alive machines without a lease
    (booting or idle) will not take, and never past `count` alive."""
    idle = max(0, alive - work.held)
    return max(0, min(count - alive, work.claimable - idle))


def _state_name(qr: tpu_v2.QueuedResource) -> str:
    return tpu_v2.QueuedResourceState.State(qr.state.state).name


@dataclasses.dataclass
class Keeper:
    clients: tpu.TpuClients | None
    spec: specs.TpuSpec
    launch: specs.Launch
    project: str
    zones: Sequence[str]
    count: int
    work: Callable[[], Work]
    dry_run: bool = False
    before_create: Callable[[str, str], None] | None = None

    def __post_init__(self) -> None:
        if not self.zones:
            raise KeeperError("give at least one zone (--zone, repeatable: the first is preferred)")
        if self.count < 1:
            raise KeeperError(f"--count must be at least 1, got {self.count}")
        if not self.spec.use_queued_resources:
            raise KeeperError(f"spec {self.spec.name!r} makes plain nodes (queued: false); the keeper manages queued resources")
        self._pattern = re.compile(rf"^{re.escape(self.spec.name)}-(\d{{4,}})$")
        self._recently_failed: set[str] = set()

    def _mine(self, zone: str) -> list[tpu_v2.QueuedResource]:
        if self.clients is None:
            raise KeeperError("no TPU API client (dry run without listing)")
        try:
            listed = self.clients.list_queued_resources(self.project, zone)
        except gapi.API_ERRORS as err:
            raise KeeperError(f"listing queued resources in {tpu.location(self.project, zone)} failed: {err}") from None
        return [qr for qr in listed if self._pattern.match(qr.name.rsplit("/", 1)[-1])]

    def _send(self, request: proto.Message) -> None:
        if self.dry_run:
            gapi.print_dry_run([request])
            return
        assert self.clients is not None
        self.clients.send(request)

    def step(self) -> StepReport:
        report = StepReport(work=self.work())
        if report.drained:
            log.info("event=keeper_drained complete=true claimable=%d held=%d action=stop", report.work.claimable,
                     report.work.held)  # fmt: skip
            return report
        by_zone = {zone: self._mine(zone) for zone in self.zones}
        used = set()
        for zone, resources in by_zone.items():
            for qr in resources:
                rid = qr.name.rsplit("/", 1)[-1]
                used.add(int(self._pattern.match(rid).group(1)))
                state = _state_name(qr)
                if state in DEAD:
                    if state == "FAILED":
                        self._recently_failed.add(zone)
                    log.warning("event=keeper_replacing queued_resource=%s zone=%s state=%s", rid, zone, state)
                    try:
                        self._send(tpu.delete_queued_resource(qr.name))
                    except gapi.API_ERRORS as err:
                        log.error("event=keeper_delete_failed queued_resource=%s error=%s", rid, err)
                        continue
                    report.deleted.append(rid)
                elif state in ALIVE or state == "STATE_UNSPECIFIED":
                    report.alive.append(rid)
        wanted = replacements(self.count, len(report.alive), report.work)
        next_index = max(used, default=-1) + 1
        # Zones where a resource just FAILED (capacity) go last; the order is otherwise the user's.
        zones = sorted(self.zones, key=lambda z: (z in self._recently_failed, list(self.zones).index(z)))
        for _ in range(max(0, wanted)):
            rid = f"{self.spec.name}-{next_index:04d}"
            next_index += 1
            for zone in zones:
                request = tpu.create_queued_resource(
                    self.project, zone, rid, specs.queued_resource(self.spec, self.launch, self.project, zone, rid)
                )
                if self.before_create is not None and not self.dry_run:
                    self.before_create(zone, rid)
                try:
                    self._send(request)
                except gapi.API_ERRORS as err:
                    log.warning("event=keeper_zone_refused zone=%s queued_resource=%s error=%s", zone, rid, err)
                    report.refused.append(f"{zone}: {err}")
                    continue
                log.info("event=keeper_created queued_resource=%s zone=%s", rid, zone)
                report.created.append(f"{zone}/{rid}")
                break
            else:
                log.error("event=keeper_no_zone queued_resource=%s zones=%s", rid, ",".join(zones))
                break  # every zone refused; try again next step
        log.info(
            "event=keeper_step claimable=%d held=%d alive=%d deleted=%d created=%d refused=%d",
            report.work.claimable, report.work.held, len(report.alive), len(report.deleted), len(report.created),
            len(report.refused),
        )
        return report

    def run(self, interval_s: float = 60.0, max_steps: int | None = None, sleep: Callable[[float], None] = time.sleep) -> StepReport:
        """Step every `interval_s` until the queue is complete (or `max_steps`)."""
        steps = 0
        while True:
            report = self.step()
            steps += 1
            if report.drained or (max_steps is not None and steps >= max_steps):
                return report
            sleep(interval_s)
