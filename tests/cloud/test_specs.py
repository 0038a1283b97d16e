"""fleet.specs: one schema for templates/*.yaml, validated before any API call, and its API objects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fleet import specs

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, base: str, **changes) -> Path:
    raw = yaml.safe_load((REPO / "templates" / base).read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path = tmp_path / base
    path.write_text(yaml.safe_dump(raw))
    return path


def test_shipped_templates_are_valid():
    vm = specs.load_spec(REPO / "templates" / "vm.yaml")
    tpu = specs.load_spec(REPO / "templates" / "tpu.yaml")
    assert isinstance(vm, specs.VmSpec) and isinstance(tpu, specs.TpuSpec)
    assert tpu.use_queued_resources is tpu.spot is True


# One case per rule the hand-written validator checked and no test above pinned.
RULES_UNTESTED_BEFORE = [
    ("vm.yaml", {"consumer": "  "}, "field 'consumer' must be a non-empty string, got '  '"),
    ("vm.yaml", {"image": 7}, "field 'image' must be a non-empty string, got 7"),
    ("vm.yaml", {"name": "a" * 51}, "field 'name' must be lowercase letters, digits and hyphens"),
    ("vm.yaml", {"spawn_flags": "--on-empty delete"}, "field 'spawn_flags' must be a list of non-empty strings"),
    ("vm.yaml", {"spawn_flags": ["--lease-ttl", 120]}, "field 'spawn_flags[1]' must be a non-empty string, got 120"),
    ("vm.yaml", {"extras": ["Extract"]}, "field 'extras[0]' must be a package extra"),
    ("vm.yaml", {"labels": {"team": "ML"}}, "field 'labels' has label 'team': 'ML'"),
    ("vm.yaml", {"labels": {"run": 5}}, "field 'labels' has label 'run': 5"),
    ("vm.yaml", {"labels": ["team"]}, "field 'labels' must be a mapping of label keys to values"),
    ("vm.yaml", {"gpu_count": -1}, "field 'gpu_count' must be a non-negative integer, got -1"),
    ("vm.yaml", {"gpu_count": 1}, "fields 'gpu_type' and 'gpu_count' go together"),
    (
        "vm.yaml",
        {"gpu_type": "nvidia-tesla-t4", "gpu_count": 1, "accelerator": "cpu"},
        "field 'accelerator' is 'cpu' but the spec attaches GPUs; use 'gpu'",
    ),
    ("vm.yaml", {"max_run_duration_s": 120 * 86400 + 1}, "field 'max_run_duration_s' must be a number of seconds"),
    ("vm.yaml", {"max_idle_s": 0}, "field 'max_idle_s' must be a positive integer, got 0"),
    ("vm.yaml", {"external_ip": 1}, "field 'external_ip' must be true or false, got 1"),
    ("tpu.yaml", {"slices": 0}, "field 'slices' must be a positive integer, got 0"),
    ("tpu.yaml", {"queued": "no"}, "field 'queued' must be true or false, got 'no'"),
    ("tpu.yaml", {"accelerator_type": "v5litepod-0"}, "field 'accelerator_type' must be a TPU accelerator type"),
    ("tpu.yaml", {"runtime_version": None}, "field 'runtime_version' is required for kind 'tpu'"),
]


@pytest.mark.parametrize(
    "base, changes, message",
    [
        ("vm.yaml", {"disk_gb": -5}, "field 'disk_gb' must be a positive integer, got -5"),
        ("vm.yaml", {"disk_gb": True}, "field 'disk_gb' must be a positive integer, got True"),
        ("vm.yaml", {"spot": "yes"}, "field 'spot' must be true or false, got 'yes'"),
        ("vm.yaml", {"name": "Bad_Name"}, "field 'name' must be lowercase letters"),
        ("vm.yaml", {"accelerator": "tpu"}, "field 'accelerator' must be one of cpu, gpu, got 'tpu'"),
        ("vm.yaml", {"labels": {"Team": "x"}}, "field 'labels' has label 'Team'"),
        ("vm.yaml", {"python": "python3 -c evil"}, "field 'python' must be a CPython version of at least 3.11"),
        ("vm.yaml", {"python": "3.10"}, "field 'python' must be a CPython version of at least 3.11"),
        ("vm.yaml", {"max_run_duration_s": 5}, "field 'max_run_duration_s' must be a number of seconds between 30"),
        ("vm.yaml", {"scopes": []}, "field 'scopes' must list at least one OAuth scope"),
        ("vm.yaml", {"machine_type": None}, "field 'machine_type' is required for kind 'vm'"),
        ("vm.yaml", {"disk_size": 10}, "unknown field 'disk_size' for kind 'vm'"),
        ("vm.yaml", {"gpu_type": "nvidia-tesla-t4"}, "fields 'gpu_type' and 'gpu_count' go together"),
        ("vm.yaml", {"kind": "gke"}, "field 'kind' must be one of vm, tpu, got 'gke'"),
        ("tpu.yaml", {"machine_type": "n2"}, "unknown field 'machine_type' for kind 'tpu'"),
        ("tpu.yaml", {"accelerator_type": "v5e"}, "field 'accelerator_type' must be a TPU accelerator type"),
    ]
    + RULES_UNTESTED_BEFORE,
)
def test_bad_field_is_named_with_file_and_value(tmp_path: Path, base: str, changes: dict, message: str):
    path = _write(tmp_path, base, **changes)
    with pytest.raises(specs.SpecError) as caught:
        specs.load_spec(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)


def test_unreadable_or_non_mapping_spec_is_a_spec_error(tmp_path: Path):
    with pytest.raises(specs.SpecError, match="cannot read"):
        specs.load_spec(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(specs.SpecError, match="must be a YAML mapping"):
        specs.load_spec(tmp_path / "list.yaml")


def test_launch_rejects_local_queue_and_code_urls(tmp_path: Path):
    spec = specs.load_spec(REPO / "templates" / "vm.yaml")
    with pytest.raises(specs.SpecError, match="--queue must be a gs://"):
        specs.Launch.make(spec, "/tmp/queue", "gs://bkt/code")
    with pytest.raises(specs.SpecError, match="--code must be a gs://"):
        specs.Launch.make(spec, "gs://bkt/q", "gs://")


def test_spot_template_deletes_on_preemption_and_carries_the_launch_attributes():
    spec = specs.load_spec(REPO / "templates" / "vm.yaml")
    launch = specs.Launch.make(spec, "gs://bkt/jobs/j/", "gs://bkt/code/c", spawn_flags=["--lease-ttl", "60", "--log-level", "a b"])
    template = specs.instance_template(spec, launch)
    props = template.properties
    assert props.scheduling.provisioning_model == "SPOT"
    assert props.scheduling.instance_termination_action == "DELETE"
    assert props.scheduling.on_host_maintenance == "TERMINATE"
    items = {i.key: i.value for i in props.metadata.items}
    assert items == {
        "startup-script": (REPO / "startup" / "startup.sh").read_text(),
        "spawn-queue": "gs://bkt/jobs/j",
        "spawn-code": "gs://bkt/code/c",
        "spawn-consumer": spec.consumer,
        "spawn-flags": "--lease-ttl 60 --log-level 'a b' --resident",
        "spawn-accelerator": "gpu",
        "spawn-extras": "extract",
        "spawn-python": spec.python,
    }
    # cloud-platform: the boot's projects.testIamPermissions needs it; IAM roles do the limiting.
    assert props.service_accounts[0].scopes == ["https://www.googleapis.com/auth/cloud-platform"]


def test_standard_cpu_vm_migrates_and_gpu_vm_terminates_on_maintenance(tmp_path: Path):
    cpu = specs.load_spec(_write(tmp_path, "vm.yaml", spot=False, accelerator="cpu", machine_type="n2-standard-4"))
    launch = specs.Launch.make(cpu, "gs://bkt/q", "gs://bkt/c")
    assert specs.instance_template(cpu, launch).properties.scheduling.on_host_maintenance == "MIGRATE"
    gpu = specs.load_spec(
        _write(tmp_path, "vm.yaml", spot=False, accelerator=None, machine_type="n1-standard-8", gpu_type="nvidia-tesla-t4", gpu_count=2)
    )
    props = specs.instance_template(gpu, launch).properties
    assert gpu.jax_flavour == "gpu"
    assert props.scheduling.on_host_maintenance == "TERMINATE"
    assert [(a.accelerator_type, a.accelerator_count) for a in props.guest_accelerators] == [("nvidia-tesla-t4", 2)]


def test_max_run_duration_makes_compute_engine_delete_the_vm_at_the_limit(tmp_path: Path):
    spec = specs.load_spec(_write(tmp_path, "vm.yaml", spot=False, max_run_duration_s=7200, python="python3.12"))
    assert spec.python == "3.12"
    template = specs.instance_template(spec, specs.Launch.make(spec, "gs://bkt/q", "gs://bkt/c"))
    body = json.loads(type(template).to_json(template))
    assert body["properties"]["scheduling"]["maxRunDuration"] == {"seconds": "7200"}
    assert body["properties"]["scheduling"]["instanceTerminationAction"] == "DELETE"
    items = {i["key"]: i["value"] for i in body["properties"]["metadata"]["items"]}
    assert items["spawn-python"] == "3.12"


def test_idle_cap_becomes_the_workers_idle_timeout(tmp_path: Path):
    spec = specs.load_spec(_write(tmp_path, "tpu.yaml", max_idle_s=600))
    launch = specs.Launch.make(spec, "gs://bkt/q", "gs://bkt/c")
    assert launch.spawn_flags[-3:] == ["--idle-timeout", "600", "--resident"]
    explicit = specs.Launch.make(spec, "gs://bkt/q", "gs://bkt/c", spawn_flags=["--idle-timeout", "30"])
    assert explicit.spawn_flags == ["--idle-timeout", "30", "--resident"]


@pytest.mark.parametrize("kind", ["vm.yaml", "tpu.yaml"])
def test_machines_run_a_resident_consumer_unless_the_spec_turns_it_off(tmp_path: Path, kind: str):
    on = specs.Launch.make(specs.load_spec(REPO / "templates" / kind), "gs://bkt/q", "gs://bkt/c")
    assert on.spawn_flags.count("--resident") == 1
    again = specs.Launch.make(specs.load_spec(REPO / "templates" / kind), "gs://bkt/q", "gs://bkt/c",
                              spawn_flags=["--resident"])  # fmt: skip
    assert again.spawn_flags == ["--resident"]  # never twice
    off = specs.Launch.make(specs.load_spec(_write(tmp_path, kind, resident=False)), "gs://bkt/q", "gs://bkt/c")
    assert "--resident" not in off.spawn_flags


def test_setup_cfg_requires_the_tpu_client_that_has_queued_resources():
    # tpu_v2.QueuedResource first appears in google-cloud-tpu 1.21; an older floor installs a client without it.
    import configparser
    import re as _re

    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    [line] = [r for r in config["options"]["install_requires"].split() if r.startswith("google-cloud-tpu")]
    floor = tuple(int(p) for p in _re.match(r"google-cloud-tpu>=([0-9.]+)", line).group(1).split("."))
    assert floor >= (1, 21)


def test_invalid_yaml_is_a_spec_error(tmp_path: Path):
    (tmp_path / "bad.yaml").write_text("kind: vm\nname: [unclosed\n")
    with pytest.raises(specs.SpecError, match="not valid YAML"):
        specs.load_spec(tmp_path / "bad.yaml")


def test_minimal_spec_gets_the_documented_defaults(tmp_path: Path):
    path = tmp_path / "vm.yaml"
    path.write_text("kind: vm\nname: w\nconsumer: python consume.py\nmachine_type: n2-standard-4\nimage: img\n")
    spec = specs.load_spec(path)
    assert (spec.extras, spec.python, spec.spot, spec.service_account) == (["extract"], "3.11", True, "default")
    # The default scope is expanded like a written one: the API wants the full URL.
    assert spec.scopes == ["https://www.googleapis.com/auth/cloud-platform"]
    assert (spec.labels, spec.network, spec.subnetwork, spec.external_ip) == ({}, "default", None, True)
    vm_fields = (spec.disk_gb, spec.disk_type, spec.gpu_type, spec.gpu_count, spec.jax_flavour)
    assert vm_fields == (100, "pd-balanced", None, 0, "cpu")
    assert (spec.max_idle_s, spec.max_run_duration_s, spec.spawn_flags) == (None, None, [])
    other = specs.load_spec(path)
    assert other.labels is not spec.labels and other.spawn_flags is not spec.spawn_flags  # no shared mutable default


def test_null_means_the_default_where_the_default_is_none_and_full_scope_urls_are_kept(tmp_path: Path):
    full = "https://www.googleapis.com/auth/devstorage.read_write"
    spec = specs.load_spec(_write(tmp_path, "tpu.yaml", subnetwork="sub", scopes=[full, "cloud-platform"]))
    assert spec.scopes == [full, "https://www.googleapis.com/auth/cloud-platform"] and spec.slices == 1
    raw = yaml.safe_load((REPO / "templates" / "tpu.yaml").read_text())
    spec = specs.parse_spec({**raw, "subnetwork": None, "queued": None, "max_idle_s": None}, "x.yaml")
    assert (spec.subnetwork, spec.queued, spec.max_idle_s) == (None, None, None)
