"""docs/PROTOCOL.md is a contract: every test id and code name it gives must exist.

A rule names the function that implements it and the test that checks it; a rename that leaves the
page behind makes the page lie. This reads the page's backticked names and resolves each: a test id
(`tests/x.py`, `tests/x.py::test_y`, `::test_y` for the file named last, `test_C_*` as a glob) against
the test functions the file defines; a dotted code name (`taskqueue.claims.Claimer`, or the short
`QueueView.scan_map`, `lease.marker_of`) by importing its module and following the attributes.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import importlib
import inspect
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTOCOL = REPO / "docs" / "PROTOCOL.md"
#: Where a short name (`QueueView.live`, `lease.marker_of`) is looked for.
PACKAGES = ("taskqueue", "objectstore", "reporting", "fleet", "gcs_spawner", "tests/simworld")
#: Backticked names with a dot that are files, not code.
FILE_ENDINGS = {"json", "py", "html", "yaml", "jsonl", "sh"}

_SPAN = re.compile(r"`([^`\n]+)`")
_TEST_ID = re.compile(r"^(tests/[\w/]+\.py)?((?:::[\w*\[\]-]+)*)$")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")


def protocol_names() -> tuple[list[tuple[str, str]], list[str]]:
    """The page's test ids, as (file, node) with node '' for a whole file, and its dotted code names, in page order."""
    tests, code, last_file = [], [], None
    for span in _SPAN.findall(PROTOCOL.read_text()):
        match = _TEST_ID.match(span)
        if match and (match.group(1) or match.group(2)):
            last_file = match.group(1) or last_file
            assert last_file is not None, f"{span!r}: a '::' test id before any test file is named"
            tests.append((last_file, match.group(2).removeprefix("::")))
        elif _DOTTED.match(span) and span.rsplit(".", 1)[1] not in FILE_ENDINGS:
            code.append(span)
    return list(dict.fromkeys(tests)), list(dict.fromkeys(code))


def _defined_tests(path: Path) -> set[str]:
    """`test_x` and `Class::test_x` for every test function the file defines."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.update(f"{node.name}::{item.name}" for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return {n for n in names if n.rsplit("::", 1)[-1].startswith("test")}


def _follow(value: object, attributes: list[str]) -> bool:
    for name in attributes:
        if hasattr(value, name):
            value = getattr(value, name)
        elif name == attributes[-1] and isinstance(value, type) and _instance_attribute(value, name):
            return True
        else:
            return False
    return True


def _instance_attribute(cls: type, name: str) -> bool:
    """A dataclass field without a default, or an attribute the class's methods set on `self`."""
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    return re.search(rf"\bself\.{name}\b(?:\s*:[^=\n]+)?\s*=(?!=)|\bself\.{name}\s*,.*=", inspect.getsource(cls)) is not None


def _modules_defining(name: str) -> list[str]:
    """Project modules that define `name` at their top level, or are called `name`."""
    found = []
    pattern = re.compile(rf"^(?:class {name}\b|def {name}\b|{name}\s*[:=])", re.MULTILINE)
    for package in PACKAGES:
        for path in sorted((REPO / package).glob("*.py")):
            if path.stem == name or pattern.search(path.read_text()):
                found.append(".".join(path.relative_to(REPO).with_suffix("").parts))
    return found


def resolves(dotted: str) -> bool:
    """Whether a dotted code name names something: its longest importable module prefix, then attributes;
    a short name (its first part is no module) in any project module that defines its first part."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        return _follow(module, parts[cut:])
    for module_name in _modules_defining(parts[0]):
        module = importlib.import_module(module_name)
        rest = parts[1:] if module_name.rsplit(".", 1)[-1] == parts[0] else parts
        if _follow(module, rest):
            return True
    return False


TESTS, CODE = protocol_names()


def test_the_page_gives_test_ids_and_code_names():
    # Without this, a parser that found nothing would pass every check below.
    assert len(TESTS) >= 40 and len(CODE) >= 50


@pytest.mark.parametrize("file,node", TESTS, ids=[f"{f}::{n}" if n else f for f, n in TESTS])
def test_every_test_id_in_protocol_md_exists(file: str, node: str):
    path = REPO / file
    assert path.is_file(), f"docs/PROTOCOL.md names {file}, which does not exist"
    if node:
        defined = _defined_tests(path)
        assert any(fnmatch.fnmatchcase(name, node) for name in defined), (
            f"docs/PROTOCOL.md names {file}::{node}; the file defines no such test"
        )


@pytest.mark.parametrize("name", CODE)
def test_every_code_name_in_protocol_md_resolves(name: str):
    assert resolves(name), f"docs/PROTOCOL.md names {name!r}, which no module defines"


#: "invariant 4", "invariants 4, 5 and 8", "Invariant 7": the simulation's invariants the page names.
_INVARIANTS = re.compile(r"\b[Ii]nvariants? (\d+(?:(?:, | and )\d+)*)")


def test_every_invariant_the_page_names_is_a_function_of_the_simulation():
    # Invariant N is `tests.simworld.invariants.invariant_N` (or `invariant_N_<clause>`, one per clause judged at
    # its own moment); a number the page gives without a function, or a function the page never names, is a lie.
    named = {int(n) for group in _INVARIANTS.findall(PROTOCOL.read_text()) for n in re.split(r", | and ", group)}
    module = importlib.import_module("tests.simworld.invariants")
    functions = {int(m.group(1)) for name in vars(module) if (m := re.fullmatch(r"invariant_(\d+)(?:_\w+)?", name))}
    assert named == functions and len(named) >= 10, (sorted(named), sorted(functions))
