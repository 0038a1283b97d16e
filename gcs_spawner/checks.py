"""What `up` (and `validate`) checks before anything is created, beyond the run file itself (`runfile.load_run`).

Each check raises `CheckError` naming what is wrong and what to do (exit 65), or returns what it found:

- `accelerator`: the fleet's type as the planner prices it (`reporting.pricing`): a TPU type of a family the table
  lacks (a misspelt `v6f-8`) stops here; a VM machine type it does not price goes on, saying so (`unpriced`), but
  a spending limit then needs a price (the run file's `plan.prices`, or `--prices`);
- `model_config`: the model's config.json is readable (from the mirror, the local source, the run's
  `plan.model_config`, or the Hub for a Hub source) and its family is one the extraction supports
  (`extract.config.ModelConfig`);
- `bucket_writable`: the queue's bucket exists and takes a write (one small object, then deleted);
- `code_environment`: the code prefix holds `uv/uv` and the lock of the fleet's platform (`fleet.environment`);
- `preflight`: the machines' roles, the region's quotas and the bucket's location (`fleet.preflight`).

The job and the tasks are checked by the models `consume.py` uses, in `runfile` and `gcs_spawner.tasks`.
"""

from __future__ import annotations

import json
import pathlib

from exitcodes import EX_DATAERR
from fleet import specs
from gcs_spawner.runfile import Run
from objectstore import NotFound, ObjectStore, StoreError, bucket_of

WRITE_CHECK = "run/write-check"


class CheckError(Exception):
    """A check found the run unable to work as written; the message names the field or resource and the fix."""

    exit_code = EX_DATAERR  # what a command that ends on it exits with (gcs_spawner/cli.py)


def prices_file(run: Run, given: str | None = None) -> str | None:
    """The price table a run is planned with: --prices (`given`), else the run file's `plan.prices` (from the run
    file's directory), else None (the shipped reporting/prices.json)."""
    if given is not None:
        return given
    return str(run.file.parent / run.fields.plan.prices) if run.fields.plan.prices else None


def accelerator(run: Run, prices_file: str | None = None):
    """The fleet's machine type's hourly prices (`reporting.pricing.MachinePrice`, by `pricing.check_machine_type`,
    the one check); None for a VM machine type the table does not price (`unpriced` says what that means). A TPU
    type of a family the table lacks is refused (CheckError): the table prices every size of the families it lists."""
    from reporting import pricing

    field = "fleet.spec.accelerator_type" if run.kind == "tpu" else "fleet.spec.machine_type"
    try:
        return pricing.check_machine_type(run.accelerator, run.kind, prices_file, unpriced_ok=True)
    except pricing.PriceError as err:
        raise CheckError(f"{run.file}: {field}: {err}") from None


def unpriced(run: Run, prices_file: str | None = None, hold_limit: bool = True) -> str:
    """What `plan` and `up` say of a machine type the price table does not price: that no hours or dollars can be
    stated, and how to give a price. With a spending limit, which needs a price to hold the run to, a CheckError
    asks for one (the run file's plan.prices, or --prices) instead, unless not `hold_limit` (plan: it only says)."""
    from reporting import pricing

    table = pricing.load_prices(prices_file)
    kind = "cpu_machines" if cpu_fleet(run) else "gpu_machines (with its GPU, their count and peak)"
    ask = (f"to price it, copy {table.source}, add {run.accelerator} under {kind}, and name the copy in the run "
           "file's plan.prices or pass --prices FILE")
    if hold_limit and run.fields.max_dollars is not None:
        raise CheckError(f"{run.file}: max_dollars: {run.accelerator} has no price in {table.source}, so the limit "
                         f"cannot be held; {ask}")
    return (f"plan: {run.machines} x {run.accelerator}: not in the price table {table.source}, so no hours or $ can "
            f"be stated for this run ({table.suggestion(run.accelerator).split('; or ')[0]}); {ask}")


def price_for_limit(run: Run, prices_file: str | None, ask_price, limit: float | None) -> float | None:
    """The hourly $ per machine of a type the price table does not price, which a spending limit needs: None
    without a limit. On a terminal the user is asked (`ask_price(question)`: the answer's text, or None at the end
    of input); anywhere else (`ask_price` None) a CheckError says in one line how to give it."""
    import math

    from reporting import pricing

    if limit is None:
        return None
    table = pricing.load_prices(prices_file)
    if ask_price is None:
        raise CheckError(f"{run.file}: max_dollars: {run.accelerator} has no price in {table.source}, so the limit "
                         "cannot be held; price it in a copy of the table named by the run file's plan.prices (or "
                         "--prices FILE), or run on a terminal to be asked for its price")
    kind = "spot" if run.spec.spot else "on-demand"
    question = (f"{run.accelerator} has no price in {table.source}; max_dollars needs one. Its {kind} $ per "
                "machine-hour? ")
    for _ in range(3):
        answer = ask_price(question)
        if answer is None:
            break
        try:
            value = float(answer.strip().lstrip("$").strip())
        except ValueError:
            value = -1.0
        if value > 0 and math.isfinite(value):
            return value
        question = f"a price is a number above 0, in $ per machine-hour, e.g. 2.5 (got {answer.strip()!r}): "
    raise CheckError(f"{run.file}: max_dollars: no price was given for {run.accelerator}, so the limit cannot be "
                     "held; nothing was created (or price it in the run file's plan.prices, or --prices FILE)")


def cpu_fleet(run: Run) -> bool:
    """Whether the run's machines compute on CPUs (a VM spec whose JAX is the CPU one): the planner, which derives
    hours from an accelerator's peak FLOPs, has no figure for them, only their price per hour."""
    return run.kind == "vm" and run.spec.jax_flavour == "cpu"


def cpu_fleet_price(run: Run, prices_file: str | None = None) -> str:
    """What `plan` and `up` say of a CPU fleet instead of a plan: its machines' price per hour and why there is no
    estimate. A spending limit, which nothing could hold the run to, is refused (CheckError)."""
    price = accelerator(run, prices_file)
    if price is None:
        return unpriced(run, prices_file)
    spot = run.spec.spot
    per_hour = price.spot_per_hour if spot else price.on_demand_per_hour
    if run.fields.max_dollars is not None:
        raise CheckError(f"{run.file}: max_dollars: a CPU fleet ({run.accelerator}) has no plan to hold the limit "
                         "against (the planner estimates hours from an accelerator's peak FLOPs); remove max_dollars "
                         "and bound the spend with fleet.count, or run on an accelerator the planner prices")
    return (f"plan: {run.machines} x {run.accelerator} (CPU) at {per_hour:g} $ per machine-hour "
            f"{'spot' if spot else 'on demand'}, {run.machines * per_hour:g} $ per hour for the fleet; no estimate of "
            "hours or total $: the planner derives them from an accelerator's peak FLOPs, which a CPU machine type "
            "does not have")


def model_config(run: Run):
    """The model's architecture (`extract.config.ModelConfig`) from the first readable config.json: the mirror,
    the local source directory, the run's plan.model_config, or (a Hub source) the Hub's."""
    from extract.config import ModelConfig
    from extract.errors import BadInput

    raw, where = _config_json(run)
    try:
        return ModelConfig.from_dict(raw, source=where)
    except BadInput as err:
        raise CheckError(f"{run.file}: model: {err}") from None


def _config_json(run: Run) -> tuple[dict, str]:
    from objectstore import open_store

    mirror = run.job.model
    try:
        return json.loads(open_store(mirror).read("config.json").data), f"{mirror}/config.json"
    except NotFound:
        pass  # not mirrored yet: `up` mirrors it from the source
    except (StoreError, ValueError) as err:
        raise CheckError(f"{run.file}: job.model: cannot read {mirror}/config.json: {err}") from None
    source = run.model_source
    candidates = []
    if source and pathlib.Path(source).is_dir():
        candidates.append(pathlib.Path(source) / "config.json")
    if run.fields.plan.model_config_file:
        candidates.append(run.file.parent / run.fields.plan.model_config_file)
    for path in candidates:
        try:
            return json.loads(path.read_text()), str(path)
        except (OSError, ValueError) as err:
            raise CheckError(f"{run.file}: model: cannot read {path}: {err}") from None
    if source:
        return _hub_config(run, source)
    raise CheckError(f"{run.file}: model: {mirror} holds no config.json and the run names no source to mirror from; "
                     "give model.source (a Hub id or a local checkpoint) or mirror it first (gcs-spawner mirror SOURCE DEST)")


def _hub_config(run: Run, hub_id: str) -> tuple[dict, str]:
    """config.json of a Hub model, the one file of it fetched before the mirror step."""
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(hub_id, "config.json", revision=run.fields.model.revision)
        return json.loads(pathlib.Path(path).read_text()), f"{hub_id} (Hub) config.json"
    except ImportError:
        raise CheckError(f"{run.file}: model.source {hub_id!r} is a Hub id, and huggingface_hub is not installed "
                         "(pip install .[extract]), or give plan.model_config") from None
    except Exception as err:  # noqa: BLE001 - the Hub client's errors are many; each is reported as the fix
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise CheckError(f"{run.file}: model.source: cannot read config.json of Hub model {hub_id!r} ({first}); "
                         "check the id and the network, or give plan.model_config (a local copy)") from None


def bucket_writable(store: ObjectStore, what: str = "queue") -> None:
    """Write and delete one small object under the prefix: the bucket exists and this account may write to it."""
    from google.api_core import exceptions as api_exceptions

    url = store.url(WRITE_CHECK)
    try:
        store.put(WRITE_CHECK, b"gcs-spawner write check\n")
        store.delete(WRITE_CHECK)
    except NotFound as err:
        bucket = bucket_of(url) or url
        raise CheckError(f"{what}: bucket {bucket} does not exist, or this account cannot see it ({err}); create it "
                         f"in the machines' region: gcloud storage buckets create gs://{bucket} --location=REGION") from None
    except StoreError as err:
        raise CheckError(f"{what}: cannot write {url}: {err}") from None
    except api_exceptions.Forbidden as err:
        raise CheckError(f"{what}: this account may not write {url} ({err.message}); grant it "
                         "roles/storage.objectUser on the bucket") from None
    except OSError as err:  # a local queue directory that cannot be written
        raise CheckError(f"{what}: cannot write {url}: {err}") from None


def code_environment(run: Run) -> None:
    """The code prefix holds what the machines' startup runs: uv/uv and locks/<lock>.txt for the run's platform."""
    from fleet import environment
    from objectstore import open_store

    code = run.fields.code.url
    try:
        store = open_store(code)
        if not store.list_page("", page_size=1).entries:
            raise CheckError(f"{run.file}: code.url: {code} is empty; set code.upload: true, or upload it "
                             "(gcs-spawner upload-code CODE_URL)")
        if not run.fields.code.environment:
            return
        missing = environment.environment_missing(store, run.platform)
    except StoreError as err:
        raise CheckError(f"{run.file}: code.url: cannot list {code}: {err}") from None
    if missing:
        raise CheckError(
            f"{run.file}: code.url: {code} lacks {' and '.join(missing)}, which {run.platform} machines install "
            f"from; upload it with its environment (code.upload: true, or gcs-spawner upload-code {code}), or set "
            "code.environment: false to let the machines install unpinned")


def preflight_requests(run: Run, project: str):
    """The pre-flight's view of the fleet, one request per region the fleet may use (`fleet.preflight.Request`)."""
    from fleet import preflight

    if run.kind == "vm":
        launch = specs.Launch.make(run.spec, run.queue, run.fields.code.url)
        template = specs.instance_template(run.spec, launch)
        zone = run.fields.fleet.zones[0] if run.fields.fleet.zones else None
        return [preflight.request_for_template(template, run.fields.fleet.count, zone, run.fields.fleet.region)]
    regions = dict.fromkeys(preflight.region_of(z) for z in run.fields.fleet.zones)
    first_zone = {region: next(z for z in run.fields.fleet.zones if preflight.region_of(z) == region) for region in regions}
    return [preflight.request_for_tpus(run.spec, run.machines, first_zone[r], run.queue) for r in regions]


def preflight(run: Run, project: str) -> list:
    """Every pre-flight finding for the fleet (`fleet.preflight.run_checks`), each region's, without repeats."""
    from fleet import preflight as checks

    findings, seen = [], set()
    for request in preflight_requests(run, project):
        for finding in checks.run_checks(project, request):
            if (finding.check, finding.detail) not in seen:
                seen.add((finding.check, finding.detail))
                findings.append(finding)
    return findings


def preflight_holds(run: Run, project: str, say) -> None:
    """The pre-flight's findings, each said (`say(line)`); a shortfall is refused unless the run file says
    fleet.force (`up` and `add` alike)."""
    from fleet import preflight as fleet_preflight

    try:
        fleet_preflight.enforce(preflight(run, project), run.fields.fleet.force, say, fix="set fleet.force: true")
    except fleet_preflight.PreflightError as exc:
        raise CheckError(f"{run.file}: fleet: {exc}") from None


def zones_offer(run: Run, project: str, clients=None) -> None:
    """Each zone (or the region) of the run's fleet exists and offers its spec's types (`offers`)."""
    fleet = run.fields.fleet
    offers(run.spec, list(fleet.zones), fleet.region, project, f"{run.file}: ",
           "fleet.region" if fleet.region else "fleet.zones", "fleet.spec.")


def offers(spec, zones: list[str], region: str | None, project: str, where: str, zone_field: str,
           type_field: str) -> None:
    """Each of `zones` (or `region`) exists and offers the spec's machine type, GPU type or TPU accelerator
    type, before anything is made: the Compute API's machineTypes.get and acceleratorTypes.get
    (https://cloud.google.com/compute/docs/reference/rest/v1/machineTypes/get,
    https://cloud.google.com/compute/docs/reference/rest/v1/acceleratorTypes/get), the TPU API's
    acceleratorTypes.get (https://cloud.google.com/tpu/docs/reference/rest/v2/projects.locations.acceleratorTypes/get).
    A 404 on the type is told apart from a zone that does not exist by zones.get (regions.get for a region)."""
    from google.api_core import exceptions as api_exceptions
    from google.cloud import compute_v1

    from fleet import compute, gapi

    args = gapi.client_args(compute.ENDPOINT_ENV)
    field = zone_field
    if region:
        try:
            found = compute_v1.RegionsClient(**args).get(project=project, region=region)
        except api_exceptions.NotFound:
            raise CheckError(f"{where}{zone_field}: region {region!r} does not exist in project {project}; "
                             "see 'gcloud compute regions list'") from None
        zones = [z.rsplit("/", 1)[-1] for z in found.zones][:1]

    def missing_zone(zone: str) -> bool:
        try:
            compute_v1.ZonesClient(**args).get(project=project, zone=zone)
            return False
        except api_exceptions.NotFound:
            return True

    def refuse(zone: str, type_name_field: str, type_name: str, offered: list[str], command: str) -> None:
        if not region and missing_zone(zone):
            raise CheckError(f"{where}{field}: zone {zone!r} does not exist in project {project}; give a zone "
                             "from 'gcloud compute zones list'")
        some = f" (it offers e.g. {', '.join(sorted(offered)[:6])})" if offered else ""
        raise CheckError(f"{where}{type_field}{type_name_field}: zone {zone} does not offer {type_name!r}{some}; pick another "
                         f"zone or type: '{command}'")

    def listed(names) -> list[str]:
        try:
            return list(names())
        except api_exceptions.NotFound:
            return []

    for zone in zones:
        try:
            if spec.kind == "tpu":
                from google.cloud import tpu_v2

                tpus = tpu_v2.TpuClient(**gapi.client_args("FLEET_TPU_ENDPOINT"))
                name = f"projects/{project}/locations/{zone}/acceleratorTypes/{spec.accelerator_type}"
                try:
                    tpus.get_accelerator_type(name=name)
                except api_exceptions.NotFound:
                    offered = listed(lambda: (t.type_ for t in tpus.list_accelerator_types(
                        parent=f"projects/{project}/locations/{zone}")))
                    refuse(zone, "accelerator_type", spec.accelerator_type, offered,
                           f"gcloud compute tpus accelerator-types list --zone={zone}")
                continue
            try:
                compute_v1.MachineTypesClient(**args).get(project=project, zone=zone, machine_type=spec.machine_type)
            except api_exceptions.NotFound:
                offered = listed(lambda: (t.name for t in compute_v1.MachineTypesClient(**args).list(project=project,
                                                                                                   zone=zone)))
                refuse(zone, "machine_type", spec.machine_type, offered,
                       f"gcloud compute machine-types list --zones={zone}")
            if spec.gpu_type:
                try:
                    compute_v1.AcceleratorTypesClient(**args).get(project=project, zone=zone,
                                                                  accelerator_type=spec.gpu_type)
                except api_exceptions.NotFound:
                    offered = listed(lambda: (t.name for t in compute_v1.AcceleratorTypesClient(**args).list(
                        project=project, zone=zone)))
                    refuse(zone, "gpu_type", spec.gpu_type, offered,
                           f"gcloud compute accelerator-types list --filter=zone:{zone}")
        except api_exceptions.GoogleAPICallError as err:  # credentials errors stay the login line (cli.py)
            raise CheckError(f"{where}{field}: cannot read what zone {zone} offers ({err}); check the project "
                             "and the credentials") from None


def job_addresses(run: Run) -> None:
    """Every gs:// address of the job (each of data_files, the model's mirror) is in a bucket this account can
    list, as the queue's is checked: a typo stops here naming the field, not later as a raw 404."""
    from objectstore import open_store

    where = f"{run.file}: job"
    addresses = [(f"job.data_files[{i}]", path) for i, path in enumerate(run.job.data_files) if path.startswith("gs://")]
    addresses.append(("job.model", run.job.model))
    seen = set()
    for field, address in addresses:
        bucket = address.removeprefix("gs://").split("/", 1)[0]
        if bucket in seen:
            continue
        seen.add(bucket)
        try:
            open_store(f"gs://{bucket}").list_page("", page_size=1)
        except NotFound:
            raise CheckError(f"{where}: {field.removeprefix('job.')}: bucket {bucket} of {address} does not exist, or "
                             "this account cannot see it; check the bucket's name") from None
        except StoreError as err:
            raise CheckError(f"{where}: {field.removeprefix('job.')}: cannot list bucket {bucket} of {address}: {err}") from None
