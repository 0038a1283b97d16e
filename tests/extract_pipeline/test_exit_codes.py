"""Exit codes live with the errors (extract/errors.py), and the extraction's modules import one another without a
circle (a lazy import inside a function counts too)."""

from __future__ import annotations

import ast
import logging
import pathlib

import pytest

from extract.errors import (
    EX_DATAERR,
    EX_SOFTWARE,
    EX_TEMPFAIL,
    BadInput,
    TransientIOError,
    exit_code_for,
    exit_for_failure,
)

EXTRACT = pathlib.Path(__file__).resolve().parents[2] / "extract"


def extract_imports() -> dict[str, set[str]]:
    """module -> the extract modules it imports anywhere in its source, but for imports under `if TYPE_CHECKING:`
    (annotations only: never run, so no circle at import time)."""
    graph = {}
    for path in EXTRACT.glob("*.py"):
        imported = set()
        tree = ast.parse(path.read_text())
        for guard in [n for n in ast.walk(tree) if isinstance(n, ast.If) and isinstance(n.test, ast.Name)
                      and n.test.id == "TYPE_CHECKING"]:
            guard.body = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "extract":
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("extract."):
                imported.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                imported |= {a.name.split(".")[1] for a in node.names if a.name.startswith("extract.")}
        graph[path.stem] = imported - {path.stem}
    return graph


def test_extract_modules_import_each_other_without_a_circle():
    graph = extract_imports()
    assert "multihost" in graph["cli"]  # the edge that stays; the one back is what made the circle

    def circle_from(module: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        for other in sorted(graph.get(module, ())):
            if other in path:
                return (*path[path.index(other) :], other)
            found = circle_from(other, (*path, other))
            if found:
                return found
        return None

    circles = {m: c for m in graph if (c := circle_from(m, (m,)))}
    assert not circles, circles


@pytest.mark.parametrize(
    "exc, code",
    [
        (BadInput("layers: out of range"), EX_DATAERR),
        (TransientIOError("read timed out"), EX_TEMPFAIL),
        (ConnectionError("reset"), EX_TEMPFAIL),
        (KeyError("a bug"), EX_SOFTWARE),
    ],
)
def test_exit_code_for_maps_each_failure_kind(exc, code):
    assert exit_code_for(exc) == code


def test_exit_for_failure_logs_one_line_for_expected_failures_and_reraises_bugs(caplog):
    log = logging.getLogger("tool")
    with caplog.at_level(logging.ERROR, logger="tool"):
        assert exit_for_failure(BadInput("job: bad field"), log, "plan_failed") == EX_DATAERR
    assert caplog.messages == ["event=plan_failed exit=65 error=job: bad field"]
    with pytest.raises(KeyError, match="a bug"):
        exit_for_failure(KeyError("a bug"), log, "plan_failed")
