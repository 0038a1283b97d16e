"""The consumers of a seeded world: a scripted consumer per attempt (outputs, then an ending; how it
answers SIGTERM and SIGKILL), and the resident process that serves a worker's tasks in half the worlds."""

from __future__ import annotations

import math
import random
import signal as signals
from typing import TYPE_CHECKING

from taskqueue import layout
from tests.simworld.store import SimStore

if TYPE_CHECKING:
    from tests.simworld.world import World


class ScriptedConsumer:
    """A consumer in virtual time: outputs one by one, then an ending; answers SIGTERM and SIGKILL."""

    def __init__(self, world: World, task_id: str, attempt: int, token: int, first: int, now: float):
        rng = random.Random(f"consumer-{world.config.seed}-{task_id}-{attempt}-{token}")
        self.world, self.task_id, self.token = world, task_id, token
        self.first, self.index, self.total = first, first, world.outputs[task_id]
        self.ending = rng.choices(["exit0", "exit1", "exit65", "crash", "hang"], weights=[75, 9, 3, 5, 8])[0]
        self.stop_after = rng.randint(0, max(0, self.total - first))  # outputs before a non-zero ending
        # One in six writes its outputs slowly (each inside the stuck-task backstop): tasks of minutes,
        # so that waiting workers reach their idle timeout beside live holders.
        self.step_s = rng.uniform(20.0, 35.0) if rng.random() < 1 / 6 else rng.uniform(1.0, 12.0)
        self.term_s = rng.choice([0.5, 2.0, None])  # None: ignores SIGTERM
        self.next_at = now + self.step_s
        self.exit_code: int | None = None
        self.exit_at: float | None = None

    def advance(self, store: SimStore, now: float) -> list[dict]:
        """What it did up to `now`: progress records of the outputs it wrote."""
        records = []
        while self.exit_code is None and self.exit_at is None and now >= self.next_at:
            ends_here = self.index >= self.total or (self.ending != "exit0" and self.index - self.first >= self.stop_after)
            if ends_here:
                if self.ending == "hang":
                    self.next_at = math.inf
                    break
                self.exit_code = {"exit0": 0, "exit1": 1, "exit65": 65, "crash": -signals.SIGSEGV}[self.ending]
                break
            name = f"{layout.output_prefix(self.task_id, self.token)}/part-{self.index}"
            try:
                store.put(name, f"{self.task_id}:{self.index}".encode())
            except Exception:  # noqa: BLE001 - a consumer whose write failed exits non-zero, as consume.py does
                self.exit_code = 1
                break
            records.append({"task": self.task_id, "token": self.token, "index": self.index, "output": name,
                            "counters": {"rows": 1 + self.index % 3}})  # fmt: skip
            self.index += 1
            self.next_at += self.step_s
        if self.exit_at is not None and now >= self.exit_at and self.exit_code is None:
            self.exit_code = 128 + signals.SIGTERM
        return records

    def signal(self, signum: int, now: float) -> None:
        if self.exit_code is not None:
            return
        if signum == signals.SIGKILL:
            self.exit_code = -signals.SIGKILL
        elif self.term_s is not None and self.exit_at is None:
            self.exit_at = now + self.term_s

    def wake_at(self) -> float:
        """When it next does something: its exit once SIGTERM reached it (it writes nothing more), else its next step."""
        return self.exit_at if self.exit_at is not None else self.next_at


class SimResident:
    """A resident consumer process (taskqueue.process.ResidentConsumer) in virtual time: which tasks it served,
    whether a signal reached it, whether it said its state was sound, and whether it dies before its next task."""

    def __init__(self, world: World, machine: str, number: int) -> None:
        self.name = f"{machine}/resident-{number}"
        self.signalled = False
        self.sound = True  # it said it stays (its last reply's `stays`)
        self.served: list[str] = []
        self.dies_idle = random.Random(f"resident-{world.config.seed}-{self.name}").random() < 0.1

    def reply(self, consumer: ScriptedConsumer) -> tuple[int | None, bool]:
        """Its reply to the task `consumer` scripted: (exit code, stays), or (None, False) when it died on the task
        without one (a crash, SIGKILL). A clean end or the task's bad input keeps it; exit 1 and a SIGTERM it acted
        on do not. One that ignores SIGTERM knows of no stop, and says it stays: only the worker core keeps it out."""
        code = consumer.exit_code
        if code is None or code < 0:
            return None, False
        return code, code in (0, 65) and consumer.exit_at is None
