"""Any machine type the zone offers: the price table prices the common ones, and a type it does not price is
planned as unpriced (the plan says so) while a spending limit asks for a price, never refused as "a TPU type"."""

from __future__ import annotations

import json

import pytest

from gcs_spawner.cli import main
from reporting import pricing
from tests.cli.conftest import PROJECT, REPO

COMMON = {  # type -> (kind, GPU model or None)
    "n1-standard-8": ("gpu", "NVIDIA T4"), "g2-standard-4": ("gpu", "NVIDIA L4"),
    "a3-ultragpu-8g": ("gpu", "NVIDIA H200 141GB"), "a4-highgpu-8g": ("gpu", "NVIDIA B200"),
    "n2-standard-16": ("cpu", None), "c3-standard-8": ("cpu", None),
}  # fmt: skip


def test_the_common_machine_types_are_priced_each_with_its_source_and_date():
    """Each is priced; one that no refresh read from Google's page says so wherever it is used (`unconfirmed`),
    naming the page to check; a GPU machine type's GPUs have a memory figure for the plan."""
    from extract import memory

    table = pricing.load_prices()
    for name, (kind, gpu) in COMMON.items():
        price = table.machine_price(name)
        assert 0 < price.spot_per_hour < price.on_demand_per_hour, name
        note = table.unconfirmed(name)
        assert note and "never confirmed" in note and "https://cloud.google.com/compute/" in note, name
        assert table.read_on(name) == "2026-11-28"
        if kind == "gpu":
            assert table.accelerator(name).family == gpu and memory.hbm_bytes(gpu), name


def test_an_unpriced_type_is_refused_with_types_of_its_own_kind():
    table = pricing.load_prices()
    with pytest.raises(pricing.PriceError) as gpu:
        table.accelerator("g2-standard-96")
    assert "TPU" not in str(gpu.value) and "GPU machine types priced: " in str(gpu.value)
    assert "g2-standard-8" in str(gpu.value) and "n2-standard-16" in str(gpu.value) and "--prices" in str(gpu.value)
    with pytest.raises(pricing.PriceError) as tpu:
        table.accelerator("v6f-8")
    assert "use a TPU type such as" in str(tpu.value) and "g2-standard-8" not in str(tpu.value)


def _unpriced_run(world, **changes):
    spec = (REPO / "templates" / "vm.yaml").read_text().replace("machine_type: g2-standard-8",
                                                                 "machine_type: g2-standard-96")
    assert "g2-standard-96" in spec
    (world.dir / "vm.yaml").write_text(spec)
    world.cloud.offer(PROJECT, "us-central1-a", machine_types=("g2-standard-96",))  # the zone offers it: only the price lacks
    return world.run_file("vm", fleet={"spec": "vm.yaml"}, **changes)


def test_an_unpriced_machine_type_is_planned_as_such_and_a_spending_limit_asks_for_a_price(world, capsys):
    """plan says no hours or $ can be stated and how to price the type (exit 0); up with max_dollars stops (65)
    asking for a price, creating nothing; the run file's plan.prices naming a copy of the table that prices it
    lets the same up go on, holding the limit to that price."""
    run_file = _unpriced_run(world)
    assert main(["plan", str(run_file)]) == 0
    said = capsys.readouterr().out
    assert "g2-standard-96: not in the price table" in said and "no hours or $" in said and "plan.prices" in said
    assert "TPU" not in said

    limited = _unpriced_run(world, max_dollars=100.0)
    assert main(["up", str(limited), "--dry-run", "--no-preflight"]) == 65
    err = capsys.readouterr().err
    assert "max_dollars: g2-standard-96 has no price" in err and "plan.prices" in err and "--prices" in err
    assert world.cloud.mutations() == [] and world.names() == []

    table = json.loads((REPO / "reporting" / "prices.json").read_text())
    table["gpu_machines"]["g2-standard-96"] = {"gpu": "NVIDIA L4", "gpus": 8, "peak_bf16_tflops_per_gpu": 121,
                                               "on_demand_per_hour": 8.0, "spot_per_hour": 3.0}  # fmt: skip
    (world.dir / "my-prices.json").write_text(json.dumps(table))
    priced = _unpriced_run(world, max_dollars=100.0, plan={"prices": "my-prices.json"})
    assert main(["up", str(priced), "--dry-run", "--no-preflight"]) == 0
    out = capsys.readouterr().out
    assert "accelerator g2-standard-96: 8 x NVIDIA L4" in out and "(8.00 / 3.00 $/machine-hour)" in out
    assert "would send InsertInstanceGroupManagerRequest" in out


def _up_on_a_terminal(world, run_file, answers: list[bytes], interrupt_at: str | None = None):
    """`gcs-spawner up RUN` with stdin a pseudo-terminal, each answer written once the question before it shows on
    stderr (or, with `interrupt_at`, SIGINT once that text shows: Ctrl-C at the prompt); (exit, stdout, stderr)."""
    import os
    import pty
    import signal
    import subprocess
    import sys

    controller, terminal = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-m", "gcs_spawner", "up", str(run_file), "--no-preflight"],
                               cwd=REPO, env=env, stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(terminal)
    err = b""
    try:
        for question in [b"machine-hour? ", b"e.g. 2.5 (got 'abc'): ", b"Proceed? [y/N] "][:len(answers) or 3]:
            while question not in err and (interrupt_at is None or interrupt_at.encode() not in err):
                chunk = os.read(process.stderr.fileno(), 4096)
                if not chunk:
                    break
                err += chunk
            if interrupt_at is not None and interrupt_at.encode() in err:
                process.send_signal(signal.SIGINT)
                break
            if not answers:
                break
            os.write(controller, answers.pop(0))
        out, rest = process.communicate(timeout=120)
    finally:
        os.close(controller)
    return process.returncode, out.decode(), (err + rest).decode()


def test_up_on_a_terminal_asks_the_price_of_an_unpriced_type_holds_the_limit_to_it_and_records_it(world, capsys):
    """An unpriced type with max_dollars: on a terminal up asks its hourly price (a wrong answer is asked again),
    says what the limit buys at it, records it in run/run.json, and status prices the fleet's machine-hours at
    it; without a terminal the same up exits 65 in one line naming --prices and plan.prices; Ctrl-C at the
    question leaves nothing made."""
    run_file = _unpriced_run(world, max_dollars=100.0)
    code, out, err = _up_on_a_terminal(world, run_file, [], interrupt_at="machine-hour? ")
    assert code == 1 and "interrupted" in err, err
    assert world.cloud.mutations() == [] and world.names() == []

    assert main(["up", str(run_file), "--no-preflight", "--yes"]) == 65  # --yes: nothing may be asked
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "max_dollars: g2-standard-96 has no price" in said[0]
    assert "plan.prices" in said[0] and "--prices FILE" in said[0] and "terminal" in said[0]
    assert world.cloud.mutations() == [] and world.names() == []

    code, out, err = _up_on_a_terminal(world, run_file, [b"abc\n", b"$4\n", b"y\n"])
    assert code == 0, err
    assert "g2-standard-96 has no price in" in err and "Its spot $ per machine-hour? " in err
    assert "plan: 2 x g2-standard-96 at 4 $ per machine-hour" in out and "8 $ per hour for the fleet" in out
    assert "max_dollars 100.00 $ lasts 12.5 h of the whole fleet" in out
    assert json.loads(world.store().read("run/run.json").data)["prices"] == {"g2-standard-96": 4.0}
    assert f"projects/{PROJECT}/zones/us-central1-a/instanceGroupManagers/r1" in world.cloud.ours()

    import datetime as dt

    from fleet.machines import make_record, write_record

    now = dt.datetime.now(dt.timezone.utc)
    since = (now - dt.timedelta(seconds=1810)).isoformat(timespec="seconds")
    write_record(world.store(), make_record("r1-abcd", "working", at=now - dt.timedelta(seconds=10), since=since,
                                            machine_type="g2-standard-96", beat_s=60, spot=True))
    capsys.readouterr()
    assert main(["status", str(run_file), "--json"]) == 0
    cost = json.loads(capsys.readouterr().out)["fleet"]["cost"]
    assert cost["unpriced_seconds"] == {} and 1.9 < cost["total_dollars"] < 2.2  # half an hour at 4 $
