"""Host and device overlapped (issue 28): the run loop dispatches the next steps while the host still reads an
earlier one's outputs, each step's device-to-host copy starts at dispatch, and the writer's bounded queue holds the
device ahead by exactly the steps the memory model counts (`extract.memory.HELD_STEPS`).

Pinned by order, not by timing: the host's read of step 0 is held until later steps are dispatched. A loop that
waited for a step's outputs before dispatching the next would never dispatch them, and the test fails at its
timeout instead of passing slowly.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import pytest

from extract import memory as mem
from extract.consumer import RunInputs, run
from extract.engine import Engine
from extract.job import Job, Task
from tests.extract_pipeline.conftest import base_job

#: How long the held read waits for later dispatches; reached only when the loop does not overlap (a failure).
WAIT_S = 120.0
#: How long the held read then watches for a dispatch beyond the bound.
SETTLE_S = 1.0


class HostReads(dict):
    """A step's outputs as the run loop hands them to the writer; the writer's collector reads them by layer."""

    def __init__(self, hidden, step: int, engine: RecordingEngine):
        super().__init__(hidden)
        self._step, self._engine = step, engine

    def __getitem__(self, layer):
        self._engine.host_reads(self._step)
        return super().__getitem__(layer)


class RecordingEngine:
    """The real engine; its dispatches and the host's reads of their outputs are logged in order, and the read of
    step 0 is held until the loop has dispatched all it can (or WAIT_S passes)."""

    def __init__(self, engine: Engine, copies_started: set[int]):
        self._engine = engine
        self._copies_started = copies_started
        self._changed = threading.Condition()
        self.events: list[tuple[str, int]] = []
        self.copy_started_at_dispatch: list[bool] = []
        self.dispatched_while_step0_held: list[int] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def forward(self, *args):
        hidden = self._engine.forward(*args)
        with self._changed:
            step = sum(kind == "dispatch" for kind, _ in self.events)
            self.copy_started_at_dispatch.append(all(id(a) in self._copies_started for a in hidden.values()))
            self.events.append(("dispatch", step))
            self._changed.notify_all()
        return HostReads(hidden, step, self)

    def _dispatched(self) -> int:
        return sum(kind == "dispatch" for kind, _ in self.events)

    def host_reads(self, step: int) -> None:
        with self._changed:
            if ("read", step) in self.events:
                return
            if step == 0:
                # Everything the bound allows: step 0 at the collector, HELD_STEPS - 1 queued, one more dispatched
                # and waiting for room in the writer's queue.
                self._changed.wait_for(lambda: self._dispatched() >= mem.HELD_STEPS + 1, timeout=WAIT_S)
                self._changed.wait(timeout=SETTLE_S)  # a loop without the bound would dispatch more meanwhile
                self.dispatched_while_step0_held.append(self._dispatched())
            self.events.append(("read", step))


@pytest.fixture
def copies_started(monkeypatch) -> set[int]:
    """ids of the arrays whose device-to-host copy was started (JAX's own method, called through)."""
    started: set[int] = set()
    array_type = type(jnp.zeros(()))  # JAX's concrete array class, whatever its private name
    original = array_type.copy_to_host_async

    def spy(self):
        started.add(id(self))
        return original(self)

    monkeypatch.setattr(array_type, "copy_to_host_async", spy)
    return started


def test_next_steps_are_dispatched_while_the_host_reads_an_earlier_one_up_to_the_held_steps_bound(
    tmp_path, tiny_models, corpus, copies_started
):
    # One bucket: every step runs the program compiled at step 0, so dispatching is all the loop does meanwhile.
    job = Job.from_dict(base_job(tiny_models["qwen2"], corpus, max_seq_len=64, buckets=[64], batch_size=4))
    task = Task.from_dict({"id": "t000024", "files": corpus.slice_files([(0, 0, 24)])})
    engine = RecordingEngine(
        Engine(job.model, job.layers, batch_size=4, max_seq_len=64, devices=jax.devices()[:1]), copies_started
    )
    result = run(RunInputs(job=job, task=task, output_url=str(tmp_path / "out")), engine=engine)

    steps = engine._dispatched()
    assert steps >= mem.HELD_STEPS + 2, "the slice must hold more steps than the bound lets run ahead"
    # Later steps went to the device before the host had read step 0 (a loop that waits for a step's outputs stops
    # at one, after WAIT_S), exactly as many as the memory model counts
    # on the device at once (more would be device memory the plan does not hold).
    assert engine.dispatched_while_step0_held == [mem.HELD_STEPS + 1]
    assert engine.events.index(("dispatch", mem.HELD_STEPS)) < engine.events.index(("read", 0))
    # Every step after that one waits for room, so reads and dispatches interleave at that distance from then on.
    for step in range(steps - mem.HELD_STEPS - 1):
        assert engine.events.index(("read", step)) < engine.events.index(("dispatch", step + mem.HELD_STEPS + 1))
    # Each step's outputs began their copy to the host when it was dispatched, before the host asked for them.
    assert engine.copy_started_at_dispatch == [True] * steps
    assert [r["sample_end"] for r in result.records][-1] == 24
