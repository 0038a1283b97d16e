"""List prices of accelerators and Cloud Storage, read from a dated data file, and what an accelerator type is.

The figures live in `reporting/prices.json` (its `as_of`, `sources` and `provenance` say where they come from and
how fresh they are, and its `figures` say, group by group, which page confirmed each at the last refresh and which
could not be confirmed and were kept from an older reading); this module only validates that file and answers
these questions for the planner and for status's cost:

- `PriceTable.accelerator("v5litepod-8")`: how many chips, their dense bf16 peak, and the on-demand and spot
  price per hour of one such machine (a TPU VM slice, or a GPU machine type);
- `PriceTable.storage_prices("region")`: Standard storage per GiB-month and Class A / Class B operations;
- `PriceTable.unconfirmed("v6e-8")` / `unconfirmed_storage("region")`: why a price in use is not one the last
  refresh confirmed (None when it is): its group is marked `kept` in `figures` and still holds the kept values (a
  figure someone has since edited is theirs, not the kept one); `read_on("v6e-8")`: the date its prices were read.

TPU accelerator types are `<prefix>-<N>`. For v4 and v5p, N counts TensorCores (two per chip), so `v4-8` is
4 chips; for v5e (`v5litepod-N`) and v6e, N counts chips (https://cloud.google.com/tpu/docs/v4,
https://cloud.google.com/tpu/docs/v5e, https://cloud.google.com/tpu/docs/v6e). TPUs are priced per chip-hour
(https://cloud.google.com/tpu/pricing). A GPU machine type (`a3-highgpu-8g`) comes with its GPUs attached
(https://cloud.google.com/compute/docs/gpus) and is priced per machine-hour here. A machine type without an
accelerator (`n2-standard-8`, a CPU worker) is priced per machine-hour too (`cpu_machines`); its peak, which the
planner needs, is its vCPUs times the table's `peak_fp32_gflops_per_vcpu`, an assumption that `sources.cpu_peaks`
derives (`Accelerator.peak_assumed` says so wherever it is used).

Nothing here imports the extraction code: the planner (tools/plan.py) joins prices to FLOPs.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, StrictFloat, StrictStr, ValidationError, model_validator

from exitcodes import EX_DATAERR
from schemas import Model, PositiveInt, Text, choice, cross_field, phrase, problems, rule, summary

PRICES_FILE = pathlib.Path(__file__).resolve().parent / "prices.json"
FORMAT = "gcs-spawner/prices/v1"
#: `--accelerator cpu`: the price table's first CPU machine type (`PriceTable.accelerator`).
CPU = "cpu"


class PriceError(ValueError):
    """The price file is malformed, or an accelerator type or storage class is not in it; the message names it."""

    exit_code = EX_DATAERR  # what a command that ends on it exits with (gcs_spawner/cli.py)


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One machine of a given accelerator type: a TPU VM slice or a GPU machine."""

    name: str
    family: str  # "v5e", "v6e", ... or the GPU model, or "cpu"
    chips: int  # TPU chips or GPUs (1 for a CPU machine: its cores share one host memory)
    hosts: int  # VMs that make up the machine (more than 1 only for multi-host TPU slices)
    peak_flops: float  # dense bf16 FLOP/s of the whole machine (a CPU machine: fp32, the table's per-vCPU figure)
    on_demand_per_hour: float
    spot_per_hour: float
    platform: str = "tpu"  # "tpu", "gpu" or "cpu": the JAX platform the machine computes on
    #: Where peak_flops comes from when it is an assumption rather than a datasheet's figure (a CPU's); else None.
    peak_assumed: str | None = None
    #: A CPU machine's memory (its devices' memory is the host's); None for accelerators (extract/memory.py's table).
    memory_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class MachinePrice:
    """What one machine of a priced type costs per hour: a TPU slice, a GPU or a CPU machine type."""

    name: str
    on_demand_per_hour: float
    spot_per_hour: float


@dataclasses.dataclass(frozen=True)
class StoragePrices:
    location: str  # "region" or "multi-region"
    standard_per_gib_month: float
    class_a_per_1000: float
    class_b_per_1000: float


@dataclasses.dataclass(frozen=True)
class PriceTable:
    source: str  # the file it was read from
    as_of: str
    provenance: str
    sources: Mapping[str, str]
    tpu: Mapping[str, Mapping[str, Any]]
    gpu_machines: Mapping[str, Mapping[str, Any]]
    storage: Mapping[str, StoragePrices]
    cpu_machines: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    #: Per group (`tpu.v6e`, `gpu_machines.g2-standard-8`, `storage.region`, ...): how the last refresh found it.
    figures: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)

    def known_accelerators(self) -> list[str]:
        """Examples of valid names: each TPU family's single-host type, then every GPU machine type."""
        return self._single_host_tpus() + list(self.gpu_machines)

    def _single_host_tpus(self) -> list[str]:
        """Each TPU family's type of one whole host (`v5litepod-8`): the example of a family's sizes."""
        return [f"{f['type_prefix']}-{f['chips_per_host'] * f['cores_per_chip']}" for f in self.tpu.values()]

    def accelerator(self, name: str) -> Accelerator:
        """The machine of type `name` as the planner prices it: a GPU or CPU machine type, or a TPU type of a listed
        family (any size); `cpu` is the table's first CPU machine type. A type the table lacks, or a CPU machine type
        without a peak (`peak_fp32_gflops_per_vcpu`), is a PriceError naming it and what to use instead."""
        if name == CPU:
            if not self.cpu_machines:
                raise PriceError(f"accelerator: cpu: the price table {self.source} has no cpu_machines; add one")
            name = next(iter(self.cpu_machines))
        if name in self.cpu_machines:
            m = self.cpu_machines[name]
            if m.get("peak_fp32_gflops_per_vcpu") is None:
                raise PriceError(f"accelerator: {name!r} has no peak_fp32_gflops_per_vcpu in the price table "
                                 f"{self.source}, so no hours can be stated; add it to a copy of the table and pass "
                                 "it with --prices")  # fmt: skip
            return Accelerator(
                name=name, family="cpu", chips=1, hosts=1,
                peak_flops=m["vcpus"] * m["peak_fp32_gflops_per_vcpu"] * 1e9,
                on_demand_per_hour=m["on_demand_per_hour"], spot_per_hour=m["spot_per_hour"], platform="cpu",
                memory_bytes=int(m["memory_gib"] * 2**30),
                peak_assumed=f"assumed: {m['vcpus']} vCPUs x {m['peak_fp32_gflops_per_vcpu']:g} GFLOP/s fp32 each "
                             f"({self.sources.get('cpu_peaks', 'no source given')})",
            )  # fmt: skip
        if name in self.gpu_machines:
            m = self.gpu_machines[name]
            return Accelerator(
                name=name,
                family=m["gpu"],
                chips=m["gpus"],
                hosts=1,
                peak_flops=m["gpus"] * m["peak_bf16_tflops_per_gpu"] * 1e12,
                on_demand_per_hour=m["on_demand_per_hour"],
                spot_per_hour=m["spot_per_hour"],
                platform="gpu",
            )
        match = re.fullmatch(r"([a-z0-9]+)-([0-9]+)", name or "")
        family = None
        if match:
            family = next((k for k, f in self.tpu.items() if f["type_prefix"] == match.group(1)), None)
        if family is None:
            raise PriceError(f"accelerator: {name!r} is not in the price table {self.source}; {self.suggestion(name)}")
        f = self.tpu[family]
        units = int(match.group(2))
        if units % f["cores_per_chip"]:
            raise PriceError(
                f"accelerator: {name!r} counts TensorCores, {f['cores_per_chip']} per {family} chip; "
                f"use a multiple of {f['cores_per_chip']}"
            )
        chips = units // f["cores_per_chip"]
        if chips == 0:
            raise PriceError(f"accelerator: {name!r} has no chips")
        return Accelerator(
            name=name,
            family=family,
            chips=chips,
            hosts=-(-chips // f["chips_per_host"]),
            peak_flops=chips * f["peak_bf16_tflops_per_chip"] * 1e12,
            on_demand_per_hour=chips * f["on_demand_per_chip_hour"],
            spot_per_hour=chips * f["spot_per_chip_hour"],
        )

    def suggestion(self, name: str) -> str:
        """What to use instead of an unpriced `name`: types of its own kind (a TPU type's family sizes, or the GPU
        and CPU machine types), and how to price it."""
        if is_tpu_type(name):
            return (f"use a TPU type such as {', '.join(self._single_host_tpus())} (any size of those families), or "
                    "add its family to a copy of the table and pass it with --prices")  # fmt: skip
        return (f"GPU machine types priced: {', '.join(self.gpu_machines)}; CPU machine types: "
                f"{', '.join(self.cpu_machines) or 'none'}; or add it to a copy of the table and pass it with --prices")

    def priced(self, name: str) -> bool:
        """Whether the table prices machine type `name` (a TPU type of a listed family, a GPU or a CPU type)."""
        try:
            self.machine_price(name)
        except PriceError:
            return False
        return True

    def machine_price(self, name: str) -> MachinePrice:
        """The hourly prices of any priced machine type: a CPU machine type, else an accelerator
        (`accelerator`'s rules and errors)."""
        if name in self.cpu_machines:
            m = self.cpu_machines[name]
            return MachinePrice(name, m["on_demand_per_hour"], m["spot_per_hour"])
        machine = self.accelerator(name)
        return MachinePrice(name, machine.on_demand_per_hour, machine.spot_per_hour)

    def _kept(self, group: str, current: Mapping[str, Any]) -> Mapping[str, Any] | None:
        figure = self.figures.get(group)
        if not figure or figure["status"] == "confirmed" or any(current.get(k) != v for k, v in figure["values"].items()):
            return None
        return figure

    def _group(self, name: str) -> tuple[str, Mapping[str, Any]]:
        if name in self.cpu_machines:
            return f"cpu_machines.{name}", self.cpu_machines[name]
        if name in self.gpu_machines:
            return f"gpu_machines.{name}", self.gpu_machines[name]
        family = self.accelerator(name).family
        return f"tpu.{family}", self.tpu[family]

    def _note(self, group: str, figure: Mapping[str, Any] | None) -> str | None:
        if figure is None:
            return None
        if figure["status"] == "unconfirmed":
            return (f"{group} prices are an estimate added on {figure['as_of']}, never confirmed from Google's page "
                    f"({self.source}, figures.{group}); check {figure['source']}")  # fmt: skip
        return (f"{group} prices are those read around {figure['as_of']}, not confirmed at the {self.as_of} refresh "
                f"({self.source}, figures.{group}); check {figure['source']}")  # fmt: skip

    def unconfirmed(self, name: str) -> str | None:
        """Why the prices of machine type `name` were not confirmed at the last refresh; None when they were (or
        when the group's figures have been edited since). `name` must be priced (`machine_price`)."""
        group, current = self._group(name)
        return self._note(group, self._kept(group, current))

    def read_on(self, name: str) -> str:
        """The date the prices of machine type `name` were read: `as_of`, or an older reading kept at the refresh."""
        figure = self._kept(*self._group(name))
        return figure["as_of"] if figure else self.as_of

    def unconfirmed_storage(self, location: str) -> str | None:
        """`unconfirmed` for a storage location's prices."""
        group = f"storage.{location}"
        return self._note(group, self._kept(group, dataclasses.asdict(self.storage_prices(location))))

    def storage_prices(self, location: str) -> StoragePrices:
        if location not in self.storage:
            raise PriceError(
                f"storage location {location!r} is not in the price table {self.source}; "
                f"use one of {', '.join(self.storage)}"
            )
        return self.storage[location]


def check_machine_type(name: str, kind: str, prices_file: str | pathlib.Path | None = None, *,
                       unpriced_ok: bool = False) -> MachinePrice | None:
    """The one check of a fleet's machine type against the price table, for `up`/`validate`/`plan`
    (gcs_spawner/checks.py) and `add` (gcs_spawner/add.py): its hourly prices, or a PriceError
    naming it and what to use instead (each caller puts the field in front, in its own error type).

    `kind` "tpu": an accelerator type, refused unless the table lists its family and the size counts whole chips
    (`PriceTable.accelerator`). `kind` "vm": a VM machine type, GPU or CPU (`PriceTable.machine_price`); one the
    table does not price is None when `unpriced_ok` (a VM type is not refused for want of a price: `up` says so),
    else refused."""
    if kind not in ("tpu", "vm"):
        raise ValueError(f"kind: got {kind!r}; use 'tpu' or 'vm'")
    prices = load_prices(prices_file)
    if kind == "tpu":
        machine = prices.accelerator(name)
        return MachinePrice(machine.name, machine.on_demand_per_hour, machine.spot_per_hour)
    if unpriced_ok and not prices.priced(name):
        return None
    return prices.machine_price(name)


def is_tpu_type(name: str) -> bool:
    """Whether `name` reads as a TPU accelerator type (`v5litepod-8`, `v6e-8`, `v4-16`), not a VM machine type
    (`g2-standard-8`, `n2-standard-16`: a series, a class and a size)."""
    return bool(re.fullmatch(r"v[0-9][a-z0-9]*-[0-9]+", name or ""))


#: A price, a peak or a size: a JSON number (not a boolean), at least 0.
Number = Annotated[StrictFloat, Field(ge=0), rule("must be a number >= 0")]
Date = Annotated[StrictStr, Field(pattern=r"^\d{4}-\d{2}-\d{2}$"), rule("must be a date, YYYY-MM-DD")]


# A TPU family and a GPU machine type are two shapes, not one: a family is priced per chip at any size (a type's
# number counts TensorCores, so its chips and hosts are worked out), a GPU machine type per machine of a fixed size.
# Their keys are the price file's format (docs/schema, every copy passed with --prices), so they stay as they are.
class TpuFamily(Model):
    """`tpu.<family>`: a TPU family, priced per chip-hour, any size (`PriceTable.accelerator`)."""

    type_prefix: Text = Field(description="the accelerator-type prefix, e.g. 'v5litepod'")
    cores_per_chip: PositiveInt = Field(description="TensorCores per chip: what the type's number counts, per chip")
    chips_per_host: PositiveInt = Field(description="chips on one TPU VM host")
    peak_bf16_tflops_per_chip: Number = Field(description="dense bf16 peak TFLOP/s of one chip")
    on_demand_per_chip_hour: Number = Field(description="on-demand $ per chip-hour")
    spot_per_chip_hour: Number = Field(description="spot $ per chip-hour")


class GpuMachine(Model):
    """`gpu_machines.<machine type>`: a VM machine type with its GPUs, priced per machine-hour."""

    gpu: Text = Field(description="the GPU model, e.g. 'NVIDIA L4'")
    gpus: PositiveInt = Field(description="GPUs on the machine")
    peak_bf16_tflops_per_gpu: Number = Field(description="dense bf16 peak TFLOP/s of one GPU")
    on_demand_per_hour: Number = Field(description="on-demand $ per machine-hour")
    spot_per_hour: Number = Field(description="spot $ per machine-hour")
    attached: str | None = Field(None, description="how the GPU is attached, for a machine type that takes one")


class CpuMachine(Model):
    """`cpu_machines.<machine type>`: a VM machine type without an accelerator, priced per machine-hour."""

    vcpus: PositiveInt = Field(description="vCPUs of the machine type")
    memory_gib: Number = Field(description="memory of the machine type, GiB")
    on_demand_per_hour: Number = Field(description="on-demand $ per machine-hour")
    spot_per_hour: Number = Field(description="spot $ per machine-hour")
    peak_fp32_gflops_per_vcpu: Number | None = Field(None, description="assumed fp32 peak GFLOP/s of one vCPU, "
                                                     "which the planner needs (sources.cpu_peaks)")  # fmt: skip


class StorageClass(Model):
    """`storage.<location>`: Standard storage and its operations in a location class."""

    standard_per_gib_month: Number = Field(description="Standard storage $ per GiB-month")
    class_a_per_1000: Number = Field(description="$ per 1,000 Class A operations")
    class_b_per_1000: Number = Field(description="$ per 1,000 Class B operations")


class Figure(Model):
    """`figures.<group>`: how the last refresh found a group's prices (`PriceTable.unconfirmed`)."""

    status: choice("confirmed", "kept", "unconfirmed", hint="must be 'confirmed' (read from the page at the "
                   "refresh), 'kept' (not found: an older reading) or 'unconfirmed' (an estimate never read from the "
                   "page)")  # fmt: skip
    as_of: Date = Field(description="the date of the reading, YYYY-MM-DD")
    source: Text = Field(description="the page the figures come from")
    note: str = ""
    values: dict[str, Number] = Field(default_factory=dict, description="the figures a kept group keeps")


class PriceFile(Model):
    """reporting/prices.json, or a copy passed with --prices (or named in a run file's plan.prices)."""

    format: choice(FORMAT)
    as_of: Date = Field(description="the date the prices were taken, YYYY-MM-DD")
    currency: str = "USD"
    region: str = ""
    refresh: str = ""
    provenance: str = ""
    sources: dict[str, str] = Field(description="the pages the figures come from, by group")
    tpu: dict[str, TpuFamily] = Field(description="TPU families by name (v5e, v6e, ...)")
    gpu_machines: dict[str, GpuMachine] = Field(description="GPU machine types")
    cpu_machines: dict[str, CpuMachine] = Field(default_factory=dict)
    storage: dict[str, StorageClass] = Field(description="storage location classes (region, multi-region)")
    figures: dict[str, Figure] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _kept_groups_name_their_values(self) -> PriceFile:
        for group, figure in self.figures.items():
            if figure.status != "confirmed" and not figure.values:
                raise cross_field(f"figures.{group}.values", "missing; a kept group names the figures it keeps, "
                                  'e.g. {"on_demand_per_hour": 0.85}')  # fmt: skip
        return self


def parse_prices(raw: Any, source: str = "prices") -> PriceTable:
    """Validate a price file's JSON by its model (`PriceFile`); every problem is a PriceError naming the file and
    the field."""
    if not isinstance(raw, Mapping):
        raise PriceError(f"{source}: must hold a JSON object")
    try:
        table = PriceFile.model_validate(raw)
    except ValidationError as error:
        raise PriceError(f"{source}: {summary(problems(error, PriceFile), phrase)}") from None
    dumped = table.model_dump()
    return PriceTable(
        source=source,
        as_of=table.as_of,
        provenance=table.provenance,
        sources=dumped["sources"],
        tpu=dumped["tpu"],
        gpu_machines=dumped["gpu_machines"],
        storage={location: StoragePrices(location=location, **spec) for location, spec in dumped["storage"].items()},
        cpu_machines=dumped["cpu_machines"],
        figures=dumped["figures"],
    )


def load_prices(path: str | pathlib.Path | None = None) -> PriceTable:
    """The price table in `path`, by default the one shipped with the package (reporting/prices.json)."""
    path = pathlib.Path(path) if path is not None else PRICES_FILE
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise PriceError(f"price file {path}: cannot be read ({exc.strerror or exc}); check the path") from exc
    except json.JSONDecodeError as exc:
        raise PriceError(f"price file {path}: not JSON ({exc}); fix the file") from exc
    return parse_prices(raw, source=str(path))
