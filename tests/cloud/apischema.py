"""Google's own API schemas for the fakes: every request a fake answers is first checked against the
discovery document Google publishes for that API, as shipped in `google-api-python-client`
(googleapiclient/discovery_cache/documents/), so no test can pass with a request Google would refuse.

What is checked, and answered with 400 INVALID_ARGUMENT as Google's APIs do
(https://cloud.google.com/apis/design/errors, "HTTP mapping": INVALID_ARGUMENT is 400, with a
`google.rpc.BadRequest` detail naming the field):
- the method exists: the HTTP method and the path match one of the document's methods (else 404);
- every query parameter is the method's own or a system parameter
  (https://cloud.google.com/apis/docs/system-parameters; the GAPIC REST transports send `$alt`);
- the body is absent when the method takes none, and otherwise matches the request schema: no
  unknown field at any depth, each value of its JSON type (proto3 JSON mapping,
  https://protobuf.dev/programming-guides/json/: 64-bit integers may be strings, enums may be
  their numbers), and each enum value one the document lists.

Formats (dates, patterns) and required fields are not checked: the documents do not mark most
required fields, so the fakes' own handlers keep doing that.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path
from typing import Any

import googleapiclient

DOCUMENTS = Path(googleapiclient.__file__).resolve().parent / "discovery_cache" / "documents"
# System parameters every Google API accepts in the query string, with or without the `$` prefix.
SYSTEM_PARAMETERS = {"$.xgafv", "access_token", "alt", "callback", "fields", "key", "oauth_token", "prettyPrint",
                     "quotaUser", "uploadType", "upload_protocol", "userIp", "userProject"}
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "uint32": (0, 2**32 - 1)}


class SchemaViolation(Exception):
    """A request Google's discovery document refuses; `status` is what the real API answers."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(message)
        self.status = status
        self.field = field


@dataclasses.dataclass(frozen=True)
class Method:
    id: str
    http_method: str
    pattern: re.Pattern
    spec: dict


class Api:
    """One discovery document: its methods, matched by HTTP method and path, and its schemas."""

    def __init__(self, name: str):
        self.name = name
        self.doc = json.loads((DOCUMENTS / f"{name}.json").read_text())
        self.schemas: dict[str, dict] = self.doc["schemas"]
        self.methods: list[Method] = []
        self._collect(self.doc)
        # The most literal pattern first, so `.../instances/{i}/start` wins over `.../instances/{i}`.
        self.methods.sort(key=lambda m: -len(m.pattern.pattern))

    def _collect(self, node: dict) -> None:
        for spec in node.get("methods", {}).values():
            template = "/" + self.doc["servicePath"] + spec.get("flatPath", spec["path"])
            # {var} is one path segment; {+var} may span several (a resource name).
            regex = "".join(
                (".+" if part.startswith("{+") else "[^/:]+") if part.startswith("{") else re.escape(part)
                for part in re.split(r"(\{[^}]+\})", template)
            )
            self.methods.append(Method(spec["id"], spec["httpMethod"], re.compile(regex + "$"), spec))
        for child in node.get("resources", {}).values():
            self._collect(child)

    def method_for(self, http_method: str, path: str) -> Method | None:
        return next((m for m in self.methods if m.http_method == http_method and m.pattern.match(path)), None)

    def check(self, http_method: str, path: str, query: dict[str, str], body: Any) -> Method:
        """The method the request calls; raises SchemaViolation where Google would refuse it."""
        method = self.method_for(http_method, path)
        if method is None:
            raise SchemaViolation(404, "", f"{self.name} has no method {http_method} {path} (Google's discovery document)")
        params = method.spec.get("parameters", {})
        for key, value in query.items():
            name = key.removeprefix("$")
            if name in SYSTEM_PARAMETERS or key in SYSTEM_PARAMETERS:
                continue
            if key not in params or params[key].get("location") != "query":
                raise SchemaViolation(400, key, f"Invalid JSON payload received. Unknown name \"{key}\": Cannot bind query "
                                                f"parameter. Field '{key}' could not be found in request message.")
            self._value(params[key], value if params[key].get("type") == "string" else _query_scalar(value), key)
        request = method.spec.get("request")
        if request is None:
            if body not in (None, {}, ""):
                raise SchemaViolation(400, "", f"Invalid JSON payload received. {method.id} takes no request body.")
        else:
            self._value(request, {} if body is None else body, "")
        return method

    def check_response(self, method: Method, body: Any) -> None:
        """The fakes' own answers must be what Google's schema allows, or a client would see fields
        (or miss values) that the real API never sends; raises AssertionError naming the field."""
        response = method.spec.get("response")
        if response is None:
            return
        try:
            self._value(response, body, "")
        except SchemaViolation as violation:
            raise AssertionError(f"the fake's answer to {method.id} breaks Google's schema: {violation}") from None

    # -- the proto3 JSON mapping, checked against a discovery schema

    def _value(self, schema: dict, value: Any, field: str) -> None:
        if "$ref" in schema:
            schema = self.schemas[schema["$ref"]]
        if value is None:
            return  # JSON null: the field's default
        kind = schema.get("type")
        if kind == "object":
            self._object(schema, value, field)
        elif kind == "array":
            if not isinstance(value, list):
                raise _type_error(field, value, "a list")
            for i, item in enumerate(value):
                self._value(schema["items"], item, f"{field}[{i}]")
        elif kind == "string":
            self._string(schema, value, field)
        elif kind == "integer":
            _integer(schema, value, field)
        elif kind == "number":
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise _type_error(field, value, "a number")
        elif kind == "boolean":
            if not isinstance(value, bool):
                raise _type_error(field, value, "true or false")
        elif kind != "any":
            raise AssertionError(f"{self.name}: schema type {kind!r} at {field} is not handled")

    def _object(self, schema: dict, value: Any, field: str) -> None:
        if not isinstance(value, dict):
            raise _type_error(field, value, "an object")
        properties = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            where = f"{field}.{key}" if field else key
            if properties is not None and key in properties:
                self._value(properties[key], item, where)
            elif extra is not None:
                self._value(extra, item, where)
            elif key == "@type" and properties is None:
                continue  # a packed Any
            else:
                at = f" at '{field}'" if field else ""
                raise SchemaViolation(400, where, f"Invalid JSON payload received. Unknown name \"{key}\"{at}: Cannot find field.")

    def _string(self, schema: dict, value: Any, field: str) -> None:
        if schema.get("format") in ("int64", "uint64") and isinstance(value, int) and not isinstance(value, bool):
            return  # proto3 JSON: 64-bit integers as numbers or strings
        enum = schema.get("enum")
        if enum is not None and isinstance(value, int) and not isinstance(value, bool):
            if 0 <= value < len(enum):
                return  # an enum by number (the GAPIC REST transports send `enum-encoding=int`)
            raise SchemaViolation(400, field, f"Invalid value at '{field}', {value} is not a valid enum number")
        if not isinstance(value, str):
            raise _type_error(field, value, "a string")
        if enum is not None and value not in enum:
            raise SchemaViolation(400, field, f"Invalid value at '{field}' ({schema.get('id', 'enum')}), \"{value}\"; "
                                              f"expected one of {', '.join(enum)}")


def _integer(schema: dict, value: Any, field: str) -> None:
    if isinstance(value, bool):
        raise _type_error(field, value, "an integer")
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value):
        value = int(value)  # proto3 JSON accepts integers as strings
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise _type_error(field, value, "an integer")
    low, high = _INT_RANGES.get(schema.get("format", "int32"), (-(2**63), 2**64 - 1))
    if not low <= value <= high:
        raise SchemaViolation(400, field, f"Invalid value at '{field}' ({schema.get('format')}), {value}: out of range")


def _query_scalar(value: str) -> Any:
    # Google's front ends read a boolean query parameter without regard to case: gcloud (apitools)
    # sends Python's `True`, and its `--force` deletes work against the real APIs.
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def _type_error(field: str, value: Any, expected: str) -> SchemaViolation:
    return SchemaViolation(400, field, f"Invalid value at '{field}', {json.dumps(value)[:80]}: expected {expected}")


@functools.cache
def api(name: str) -> Api:
    """Loaded once per test session: compute.v1 alone is 5 MB of JSON."""
    return Api(name)


def bad_request(violation: SchemaViolation) -> dict:
    """The JSON error Google's APIs answer (https://cloud.google.com/apis/design/errors, "Error model")."""
    status = "INVALID_ARGUMENT" if violation.status == 400 else "NOT_FOUND"
    error: dict = {"code": violation.status, "message": str(violation), "status": status}
    if violation.status == 400:
        error["details"] = [{"@type": "type.googleapis.com/google.rpc.BadRequest",
                             "fieldViolations": [{"field": violation.field, "description": str(violation)}]}]
    return {"error": error}
