"""How user-written files are declared: typed pydantic models, errors that name the field, JSON Schema for editors.

The job (`extract/job.py`) and the machine specs (`fleet/specs.py`) are declared with the pieces here, so that a
rule is written once and every violation reads the same way. This package sits on the bottom floor beside
`objectstore/`: it imports pydantic and nothing of the project.

- `Model` is the base of every declared file: unknown fields are errors and a validated value is frozen.
- `rule(hint)` goes last in a field's `Annotated[...]`: whatever the field's own checks reject (type, range,
  pattern, a custom `AfterValidator`) is reported as `hint` ("must be a positive integer"), never in pydantic's
  words; errors inside its elements keep their own path. The field keeps its JSON Schema (type, bounds, enum).
- `PositiveInt`, `NonNegativeInt`, `Text`, `Flag` and `choice(...)` are the rules both files share.
- `invalid(hint)` is a custom check's error; `cross_field(path, text)` the error of a rule over several fields.
- `problems(error, model)` turns a `ValidationError` into `Problem`s with paths, unknown fields first;
  `summary` puts them in one line, which each caller raises as its own error type (`BadInput`, `SpecError`).
- `json_schema(model)` is the document written to `docs/schema/` (tools/export_schema.py); `external_ref(name)`
  refers from one such file to another beside it (the run file's inline job to `job.json`).

Why pydantic rather than msgspec: docs/schema/README.md.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

__all__ = [
    "Flag", "Model", "NonNegativeInt", "PositiveInt", "Problem", "Text",
    "choice", "cross_field", "external_ref", "invalid", "json_schema", "problems", "rule", "summary",
]  # fmt: skip

#: Kinds of `Problem`: a field not declared, a required field not given, a value that breaks the field's rule,
#: a rule over several fields.
UNKNOWN, MISSING, INVALID, CROSS = "unknown", "missing", "invalid", "cross_field"


class Model(BaseModel):
    """A declared file: unknown fields are errors, and a validated value cannot change."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def invalid(hint: str) -> PydanticCustomError:
    """A field's value breaks its rule; `hint` says what it must be instead."""
    return PydanticCustomError(INVALID, "{hint}", {"hint": hint})


def rule(hint: str) -> WrapValidator:
    """The field's checks, reported as `hint`: what the value must be, e.g. "must be a positive integer"."""

    def validate(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError as error:
            if any(detail["loc"] for detail in error.errors()):
                raise  # errors inside an element or a nested model keep their own path and hint
            raise invalid(hint) from None

    return WrapValidator(validate)


# Strict types: a JSON/YAML `true` is no integer and `"yes"` no boolean. A blank string is no text.
PositiveInt = Annotated[StrictInt, Field(gt=0), rule("must be a positive integer")]
NonNegativeInt = Annotated[StrictInt, Field(ge=0), rule("must be a non-negative integer")]
Text = Annotated[StrictStr, Field(pattern=r"\S"), rule("must be a non-empty string")]
Flag = Annotated[StrictBool, rule("must be true or false")]


def choice(*options: str, hint: str | None = None) -> Any:
    """One of `options` (an enum in the JSON Schema); `hint` replaces the plain list in the message."""
    return Annotated[Literal[options], rule(hint or f"must be one of {', '.join(options)}")]


def cross_field(path: str, text: str) -> PydanticCustomError:
    """The error of a rule over several fields: `path` says where to look, `text` what is wrong and what to do."""
    return PydanticCustomError(CROSS, "{text}", {"path": path, "text": text})


@dataclasses.dataclass(frozen=True)
class Problem:
    """One violation: `path` like `dataset.config` or `files[0].end`, and `text`, which says what to write.

    `kind` is UNKNOWN (text: the fields known there), MISSING (text: the field's description), INVALID
    (text: "must be ..., got X"), or CROSS (text: the sentence of a rule over several fields).
    """

    kind: str
    path: str
    text: str


def _path(loc: Iterable[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _model_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> type[BaseModel]:
    """The model that declares the field at `loc` (list indices skipped): for ("dataset", "nme"), HubDataset."""
    for part in loc[:-1]:
        if isinstance(part, str) and part in model.model_fields:  # else a list index or a mapping's key
            model = next(_model_types(model.model_fields[part].annotation))
    return model


def _model_types(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in getattr(annotation, "__args__", ()):
        yield from _model_types(arg)


def problems(error: ValidationError, model: type[BaseModel]) -> list[Problem]:
    """The errors of validating `model`, unknown fields first, each with its path and what to write instead."""
    found = []
    details = error.errors(include_url=False)
    # An error inside an element explains its container's (a list's too_short counts only valid items).
    inner = {tuple(d["loc"])[:n] for d in details for n in range(len(d["loc"]))}
    for detail in details:
        if tuple(detail["loc"]) in inner:
            continue
        loc, kind, ctx, value = tuple(detail["loc"]), detail["type"], detail.get("ctx") or {}, detail["input"]
        if kind == "extra_forbidden":
            found.append(Problem(UNKNOWN, _path(loc), ", ".join(sorted(_model_at(model, loc).model_fields))))
        elif kind == "missing":
            found.append(Problem(MISSING, _path(loc), _model_at(model, loc).model_fields[loc[-1]].description or ""))
        elif kind == CROSS:
            found.append(Problem(CROSS, ctx["path"], ctx["text"]))
        elif kind == INVALID:
            found.append(Problem(INVALID, _path(loc), f"{ctx['hint']}, got {value!r}"))
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            found.append(Problem(INVALID, _path(loc), f"must be a mapping of field names to values, got {value!r}"))
        else:  # a check declared without rule(): pydantic's words, still under the field's path
            text = detail["msg"][:1].lower() + detail["msg"][1:]
            found.append(Problem(INVALID, _path(loc), f"{text}, got {value!r}"))
    # Unknown fields first and in name order, as the first of them is most likely the typo behind the rest.
    return sorted(found, key=lambda problem: (problem.kind != UNKNOWN, problem.path if problem.kind == UNKNOWN else ""))


def phrase(problem: Problem, where: str) -> str:
    """A problem in a line, as the job and the price table say it: unknown, missing, or the rule it broke."""
    if problem.kind == UNKNOWN:
        return f"{where}: unknown field; remove it or use one of: {problem.text}"
    if problem.kind == MISSING:
        return f"{where}: missing; a required field" + (f": {problem.text}" if problem.text else "")
    return f"{where}: {problem.text}"


def summary(found: list[Problem], phrase: Callable[[Problem, str], str], prefix: str = "", root: str = "") -> str:
    """The first problem in full, as `phrase(problem, where)` puts it, then where the others are."""

    def where(problem: Problem) -> str:
        return f"{prefix}{problem.path}" if problem.path else root

    others = sorted({where(p) for p in found[1:]} - {where(found[0])})
    return phrase(found[0], where(found[0])) + (f" (also wrong: {', '.join(others)})" if others else "")


_EXTERNAL = "x-external-ref"


def external_ref(name: str) -> dict[str, str]:
    """A reference to another schema file beside this one (`job.json`), for a field's `WithJsonSchema`.

    Pydantic resolves every `$ref` it meets among its own definitions, so the reference is written as this
    marker and turned into `{"$ref": name}` by `json_schema`; a relative `$ref` is resolved from the schema's own
    location (draft-07, section 8.3), which is how an editor finds the file."""
    return {_EXTERNAL: name}


def _resolve_external(node: Any) -> Any:
    if isinstance(node, dict):
        if set(node) == {_EXTERNAL}:
            return {"$ref": node[_EXTERNAL]}
        return {key: _resolve_external(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_resolve_external(value) for value in node]
    return node


def json_schema(model: type[BaseModel]) -> str:
    """The JSON Schema of `model` as written to docs/schema/: what an editor validates and completes against.

    Declared as draft-07, which yaml-language-server supports (docs/schema/README.md): the keywords pydantic
    emits for these models all exist there, and `#/$defs/...` references are plain JSON pointers.
    """
    document = {"$schema": "http://json-schema.org/draft-07/schema#"} | model.model_json_schema(mode="validation")
    return json.dumps(_resolve_external(document), indent=2) + "\n"
