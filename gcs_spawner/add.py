"""`gcs-spawner add RUN --spec SPEC --count N [--zone Z]`: N more machines of another machine spec on a run's queue
(a v5litepod-8 beside a run's v5litepod-16 slices, a GPU group beside a TPU fleet), recorded like `up`'s.

What it makes is the run's, and apart from the run file's own fleet:

- **Names.** NAME-SPEC, from the run's name and the added spec's `name`: the instance template and the managed
  instance group (VMs), or TPU VMs NAME-SPEC-NNNN, numbered on from the highest that exists in the zone. `up`'s
  names are NAME and NAME-NNNN (gcs_spawner/runfile.py), and a spec's name starts with a letter (fleet/specs.py),
  so they never collide.
  A second `add` of a VM spec resizes its group by N; of a TPU spec, makes N more TPU VMs.
- **Labels.** `spawn-run: NAME`, as every resource of the run, so `down` finds them by label too, and
  `spawn-add: SPEC`, so that `up` (gcs_spawner/converge.py) and the keeper (fleet/keeper.py counts only
  NAME-NNNN) leave them alone. `keep` deletes those of them that are lost while the cloud still has them.
- **Record.** Write-ahead, as `up`'s (gcs_spawner/record.py): `run/run.json` names the added group under `added`
  (its spec, type, count and zone: where `down` and `status --cloud` look by label) before anything is sent,
  and each resource's object is written `requested` before its create (gcs_spawner/fleetstep.py, FleetStep.create).
- **Checks, as `up`'s.** The run has been brought up (its record exists); the spec loads; the zone exists and
  offers the spec's types (gcs_spawner/checks.py, `offers`); the type is priced, or given a price when the run
  has a spending limit; the run has not spent its `max_dollars` (its machines' records, priced); the code prefix
  holds the spec's platform's lock; the pre-flight (roles, quotas, bucket location). A refusal exits 65, and
  nothing is made.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import re
from collections.abc import Callable
from typing import TextIO

from gcs_spawner import checks
from gcs_spawner.cloud import Clients, Declined
from gcs_spawner.record import Resource, RunRecord
from gcs_spawner.runfile import _ZONE, ADD_LABEL, RUN_LABEL, Run

log = logging.getLogger("gcs_spawner")

#: The longest NAME-SPEC: room for the -NNNN of TPU VM names within Compute Engine's and the TPU API's 63
#: characters (https://cloud.google.com/compute/docs/naming-resources).
NAME_MAX = 58


@dataclasses.dataclass
class AddReport:
    name: str = ""  # NAME-SPEC
    changes: list[str] = dataclasses.field(default_factory=list)  # what it prints before it asks
    created: list[str] = dataclasses.field(default_factory=list)
    existed: list[str] = dataclasses.field(default_factory=list)
    resized: list[str] = dataclasses.field(default_factory=list)
    deleted: list[str] = dataclasses.field(default_factory=list)
    would: list[str] = dataclasses.field(default_factory=list)


def added_run(run: Run, spec_path: pathlib.Path, count: int, zone: str | None) -> Run:
    """The run as the added machines see it: named NAME-SPEC, labelled as the module docstring says, `count`
    machines in `zone` (default: the run's first zone, or its region for a VM group)."""
    from fleet import specs

    spec = specs.load_spec(spec_path)
    name = f"{run.name}-{spec.name}"
    if len(name) > NAME_MAX:
        raise checks.CheckError(f"{spec_path}: name: the added machines would be named {name!r}, {len(name)} "
                                f"characters (at most {NAME_MAX}, with the run's name); give the spec a shorter name")
    if zone is not None and not re.fullmatch(_ZONE, zone):
        raise checks.CheckError(f"--zone: {zone!r} is not a zone; give one such as us-central1-a "
                                "('gcloud compute zones list')")
    fleet = run.fields.fleet
    region = None
    if zone is not None:
        zones = [zone]
    elif fleet.zones:
        zones = list(fleet.zones[:1])
    elif spec.kind == "vm":
        zones, region = [], fleet.region
    else:
        raise checks.CheckError(f"--zone: missing; run {run.name!r} has a region ({fleet.region}), and TPU VMs are "
                                "made in a zone: give --zone")
    labels = {**spec.labels, RUN_LABEL: run.name, ADD_LABEL: spec.name}
    spec = spec.model_copy(update={"name": name, "labels": labels})
    fields = run.fields.model_copy(update={
        "name": name, "fleet": fleet.model_copy(update={"count": count, "zones": zones, "region": region,
                                                        "keeper": False})})  # fmt: skip
    return dataclasses.replace(run, fields=fields, spec=spec)


class _Add:
    def __init__(self, run: Run, spec_path: pathlib.Path, count: int, zone: str | None, *, project: str | None,
                 dry_run: bool, yes: bool, out: TextIO, confirm: Callable[[str], bool] | None,
                 clients: Clients | None, preflight: bool, prices: str | None, ask_price=None):
        from gcs_spawner import cloud
        from objectstore import open_store

        self.run, self.spec_path, self.count = run, spec_path, count
        self.dry_run, self.yes, self.out, self.confirm = dry_run, yes, out, confirm
        self.clients, self.preflight, self.ask_price = clients or Clients(), preflight, ask_price
        self.prices = checks.prices_file(run, prices)
        self.project = cloud.resolve_project(run.file, project or run.fields.project)
        self.store = open_store(run.queue)
        self.record = RunRecord(self.store)
        self.added = added_run(run, spec_path, count, zone)
        self.report = AddReport(name=self.added.name)
        self.group_size: int | None = None  # VM: the added group's target size, when it exists
        self.first_index = 0  # TPU: the number of the first new TPU VM
        self.given_price: float | None = None  # asked for an unpriced type, recorded as up records it

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def would(self, line: str) -> None:
        self.report.would.append(line)
        self.say(f"would {line}")

    @property
    def spec_name(self) -> str:
        return self.added.spec.labels[ADD_LABEL]

    # -- checks ----------------------------------------------------------------------------------------------------

    def validate(self) -> None:
        recorded = self.record.read_run()
        if recorded is None:
            raise checks.CheckError(
                f"{self.run.file}: run {self.run.name!r} has no record at {self.store.url('run/run.json')}: bring it "
                f"up first (gcs-spawner up {self.run.file}); add makes machines beside a run's fleet, on its queue")
        if recorded.get("name") != self.run.name:
            raise checks.CheckError(
                f"{self.run.file}: name: the queue {self.run.queue} holds the record of run {recorded.get('name')!r}, "
                f"not {self.run.name!r}; add to the run that owns the queue")
        added = self.added
        checks.offers(added.spec, list(added.fields.fleet.zones), added.fields.fleet.region, self.project, "",
                      "--zone", f"{self.spec_path}: ")
        self._price()
        checks.code_environment(added)
        if self.preflight:
            checks.preflight_holds(added, self.project, self.say)
        self._existing()

    def _price(self) -> None:
        """The added type's price (refused when a TPU family is unknown), and the run's spending limit: an unpriced
        type needs a price when the run has one, and a run that has spent it gets no more machines."""
        from gcs_spawner.keep import spent_dollars
        from reporting import pricing

        added = self.added
        field = "accelerator_type" if added.kind == "tpu" else "machine_type"
        try:
            price = pricing.check_machine_type(added.accelerator, added.kind, self.prices, unpriced_ok=True)
        except pricing.PriceError as err:
            raise checks.CheckError(f"{self.spec_path}: {field}: {err}") from None
        machines = added.machines
        limit = self.run.fields.max_dollars
        if price is None:
            per_hour = self.given_price = checks.price_for_limit(added, self.prices, self.ask_price, limit)
            if per_hour is None:
                self.say(f"add: {added.accelerator} is not in the price table; no $ can be stated for it")
        else:
            per_hour = price.spot_per_hour if added.spec.spot else price.on_demand_per_hour
        if per_hour is not None:
            self.say(f"add: {machines} x {added.accelerator}{' spot' if added.spec.spot else ''} at {per_hour:g} $ "
                     f"per machine-hour: {machines * per_hour:g} $ per hour")
        if limit is not None:
            spent = spent_dollars(self.store, self.prices)
            if spent >= limit:
                raise checks.CheckError(
                    f"{self.run.file}: max_dollars: run {self.run.name!r} has spent {spent:,.2f} $ of its limit of "
                    f"{limit:,.2f} $, so add makes no more machines; raise max_dollars to go on")
            self.say(f"add: run {self.run.name!r} has spent {spent:,.2f} $ of its max_dollars {limit:,.2f} $")

    def _existing(self) -> None:
        """What exists of the added group already: VM, its template and group (this run's, or refused); TPU, the
        highest NAME-SPEC-NNNN in the zone, to number on from."""
        from gcs_spawner.fleetstep import vm_resources

        added = self.added
        if added.kind == "vm":
            for resource, exists in vm_resources(added, self.project, self.clients):
                if exists() and not self.record.is_ours(resource):
                    raise checks.CheckError(f"{resource.describe()} exists in project {self.project} and was not made "
                                            f"by run {self.run.name!r}; give the spec another name")
                if exists() and resource.kind == "instance_group":
                    self.group_size = self._group_size(resource)
            return
        zone = added.fields.fleet.zones[0]
        pattern = re.compile(rf"^{re.escape(added.name)}-(\d{{4,}})$")
        tpus = self.clients.tpu_clients()
        listed = [*tpus.list_queued_resources(self.project, zone), *tpus.list_nodes(self.project, zone)]
        numbers = [int(m.group(1)) for item in listed if (m := pattern.match(item.name.rsplit("/", 1)[-1]))]
        self.first_index = max(numbers, default=-1) + 1

    def _group_size(self, group: Resource) -> int:
        compute = self.clients.compute_clients()
        if group.zone:
            found = compute.zonal_groups.get(project=group.project, zone=group.zone, instance_group_manager=group.name)
        else:
            found = compute.regional_groups.get(project=group.project, region=group.region,
                                                instance_group_manager=group.name)
        return found.target_size

    # -- the difference, the question ------------------------------------------------------------------------------

    def difference(self) -> None:
        added, n = self.added, self.added.machines
        where = ", ".join(added.fields.fleet.zones) or added.fields.fleet.region
        if added.kind == "vm":
            if self.group_size is None:
                changes = [f"  create  instance_template {added.name} (global): {added.spec.machine_type}",
                           f"  create  instance_group {added.name} ({where}): {n} x {added.spec.machine_type}"]
            else:
                changes = [f"  resize  instance_group {added.name} ({where}): {self.group_size} -> "
                           f"{self.group_size + n} (adds {n})"]
        else:
            first, last = self.first_index, self.first_index + n - 1
            noun = "queued resource" if added.spec.use_queued_resources else "TPU VM"
            names = f"{added.name}-{first:04d}" + (f" .. {added.name}-{last:04d}" if last > first else "")
            changes = [f"  create  {n} {noun}{'s' if n != 1 else ''} ({names}): {added.spec.accelerator_type} in {where}"]
        self.report.changes = changes
        self.say(f"add: beside the fleet of run {self.run.name!r}, on its queue {self.run.queue} (project {self.project}):")
        for line in changes:
            self.say(line)

    def ask(self) -> None:
        if self.yes or self.dry_run:
            return
        if self.confirm is None:
            raise Declined("add asks before it creates anything, and stdin is not a terminal: pass --yes",
                           cannot_ask=True)
        if not self.confirm(f"add {self.added.machines} x {self.added.accelerator} to run {self.run.name!r} in "
                            f"project {self.project}. Proceed? [y/N] "):
            raise Declined("not confirmed; nothing was created")

    # -- make ------------------------------------------------------------------------------------------------------

    def apply(self) -> None:
        from fleet import specs
        from gcs_spawner.fleetstep import FleetStep

        added = self.added
        total = (self.group_size or 0) + added.machines if added.kind == "vm" else self.first_index + added.machines
        if self.dry_run:
            self.would(f"write {self.store.url('run/run.json')} (added.{self.spec_name})")
        else:  # write-ahead: where down and status --cloud look for the added group by its label
            recorded = self.record.read_run() or {}
            fleet = added.fields.fleet
            entry = {"name": added.name, "kind": added.kind, "accelerator": added.accelerator, "machines": total,
                     "zone": fleet.zones[0] if fleet.zones else None, "region": fleet.region,
                     "spot": added.spec.spot, "spec": str(self.spec_path)}
            update = {"added": {**(recorded.get("added") or {}), self.spec_name: entry}}
            if self.given_price is not None:  # status and keep price the machines with it (keep.run_prices)
                update["prices"] = {**(recorded.get("prices") or {}), added.accelerator: self.given_price}
            self.record.update_run(update)
        step = FleetStep(added, self.project, self.record, self.clients, self.report, self.dry_run, self.would,
                         added.machines, None, self.say)
        launch = specs.Launch.make(added.spec, added.queue, added.fields.code.url)
        if added.kind == "vm":
            step.vm_fleet(launch, None if self.group_size is None else self.group_size + added.machines)
        else:
            self._tpus(step, launch)
        log.info("event=added run=%s group=%s machines=%d", self.run.name, added.name, added.machines)

    def _tpus(self, step, launch) -> None:
        from fleet import launch as launching
        from fleet import specs, tpu

        added, zone = self.added, self.added.fields.fleet.zones[0]
        clients = self.clients.tpu_clients()
        for node_id in launching.tpu_names(added.name, added.machines, self.first_index):
            if added.spec.use_queued_resources:
                kind = "queued_resource"
                request = tpu.create_queued_resource(
                    self.project, zone, node_id, specs.queued_resource(added.spec, launch, self.project, zone, node_id))
            else:
                kind = "tpu_node"
                request = tpu.create_node(self.project, zone, node_id, specs.tpu_node(added.spec, launch))
            # Numbered past the highest that exists: a 409 is a create of this add whose answer was lost.
            step.create(Resource(kind, self.project, node_id, zone=zone), request, lambda: False,
                        lambda r: clients.send(r))

    def summary(self) -> None:
        file = self.run.file
        if self.dry_run:
            self.say(f"dry run: {len(self.report.would)} calls shown, none made")
            return
        made = len(self.report.created)
        self.say(f"add: {made} resource{'s' if made != 1 else ''} created now"
                 + (f", {len(self.report.resized)} resized" if self.report.resized else "")
                 + f" for run {self.run.name!r} ({self.added.name}). gcs-spawner status {file} shows them; "
                 f"gcs-spawner down {file} deletes them with the run")


def add(run: Run, spec_path: str | pathlib.Path, count: int, *, zone: str | None = None, project: str | None = None,
        dry_run: bool = False, yes: bool = False, out: TextIO | None = None,
        confirm: Callable[[str], bool] | None = None, clients: Clients | None = None, preflight: bool = True,
        prices: str | None = None, ask_price=None) -> AddReport:
    """Add `count` machines of the spec at `spec_path` to `run` (the module docstring). `confirm(question)` asks the
    user (None: cannot ask, so only `yes` or `dry_run` go on); `ask_price(question)` asks for an hourly price (None:
    cannot ask). Raises CheckError (bad input: nothing created), Declined, or fleetstep.UpError."""
    import sys

    if count < 1:
        raise checks.CheckError(f"--count: {count}; add makes 1 or more machines")
    doer = _Add(run, pathlib.Path(spec_path), count, zone, project=project, dry_run=dry_run, yes=yes,
                out=out or sys.stdout, confirm=confirm, clients=clients, preflight=preflight, prices=prices,
                ask_price=ask_price)
    doer.validate()
    doer.difference()
    doer.ask()
    doer.apply()
    doer.summary()
    return doer.report
