"""docs/schema/: the JSON Schemas editors use are the models' own, and they judge files as the models do."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from extract.job import Job
from fleet.specs import TpuSpec, VmSpec
from gcs_spawner.runfile import RunFile
from schemas import json_schema

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = {"job.json": Job, "vm-spec.json": VmSpec, "tpu-spec.json": TpuSpec, "run.json": RunFile}
JOB = {"data_files": ["/data/*.parquet"], "model": "Qwen/Qwen3-0.6B", "layers": [6, -1], "max_seq_len": 512,
       "batch_size": 8, "shard_size": 256}  # fmt: skip


def export_tool():
    """tools/export_schema.py, loaded in this process: its imports (the Google clients) cost seconds in a child."""
    spec = importlib.util.spec_from_file_location("export_schema", REPO / "tools" / "export_schema.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def editor_check(name: str, document: object) -> list[str]:
    """What a draft-07 JSON Schema validator (as in yaml-language-server) says about `document`, one path per error."""
    schema = json.loads((REPO / "docs" / "schema" / name).read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    validator = jsonschema.Draft7Validator(schema)
    return sorted(".".join(map(str, error.absolute_path)) for error in validator.iter_errors(document))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_file_is_what_the_model_exports(name: str):
    assert (REPO / "docs" / "schema" / name).read_text() == json_schema(SCHEMAS[name]), (
        f"docs/schema/{name} has drifted from its model; run tools/export_schema.py"
    )


def test_export_tool_writes_the_files_and_check_finds_a_stale_one(tmp_path: Path, capsys: pytest.CaptureFixture):
    tool = export_tool()
    assert tool.MODELS == SCHEMAS
    assert tool.main(["--dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(SCHEMAS)
    assert tool.main(["--check", "--dir", str(tmp_path)]) == 0
    stale = tmp_path / "vm-spec.json"
    stale.write_text(stale.read_text().replace('"disk_gb"', '"disk_size"'))
    assert tool.main(["--check", "--dir", str(tmp_path)]) == 1
    assert "vm-spec.json differ from the models" in capsys.readouterr().err
    assert "disk_size" in stale.read_text()  # --check writes nothing


@pytest.mark.parametrize("template", ["vm.yaml", "tpu.yaml"])
def test_templates_name_their_schema_and_pass_it(template: str):
    path = REPO / "templates" / template
    first = path.read_text().splitlines()[0]
    name = f"{template.removesuffix('.yaml')}-spec.json"
    assert first == f"# yaml-language-server: $schema=../docs/schema/{name}"
    assert (path.parent / "../docs/schema" / name).resolve().is_file()
    assert editor_check(name, yaml.safe_load(path.read_text())) == []


@pytest.mark.parametrize(
    "change, path",
    [
        ({"disk_size": 10}, ""),  # unknown field
        ({"disk_gb": 0}, "disk_gb"),
        ({"spot": "yes"}, "spot"),
        ({"name": "Bad_Name"}, "name"),
        ({"labels": {"Team": "x"}}, "labels"),
        ({"python": "3.x"}, "python"),
        ({"max_run_duration_s": 5}, "max_run_duration_s"),
        ({"accelerator": "tpu"}, "accelerator"),
    ],
)
def test_editor_rejects_what_the_vm_model_rejects(change: dict, path: str):
    raw = {**yaml.safe_load((REPO / "templates" / "vm.yaml").read_text()), **change}
    assert editor_check("vm-spec.json", raw) == [path]
    with pytest.raises(ValueError):  # SpecError, or the model's own ValidationError: both ValueErrors
        VmSpec.model_validate(raw)


@pytest.mark.parametrize(
    "change, path",
    [
        ({"layer": [3]}, ""),
        ({"layers": []}, "layers"),
        ({"layers": [1, 1]}, "layers"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"dtype": "int8"}, "dtype"),
        ({"dataset": {"name": "x"}}, ""),  # both sources
        ({"data_files": [""]}, "data_files"),
    ],
)
def test_editor_rejects_what_the_job_model_rejects(change: dict, path: str):
    raw = {**JOB, **change}
    assert editor_check("job.json", raw) == [path]
    with pytest.raises(ValueError):
        Job.model_validate(raw)


def test_editor_accepts_both_job_sources():
    assert editor_check("job.json", JOB) == []
    hub = {k: v for k, v in JOB.items() if k != "data_files"} | {"dataset": {"name": "HuggingFaceFW/fineweb-edu"}}
    assert editor_check("job.json", hub) == []
    assert editor_check("job.json", {**JOB, "data_files": "/data/one.parquet"}) == []
