"""One exact tool call: its digest (what an approval binds to) and its arguments' check.

The digest is the SHA-256 of the canonical JSON of ``{"name", "arguments", "tool"}``: keys
sorted, no spaces, UTF-8, no NaN; ``tool`` is the server as configured and the server's own
name for the tool (``McpTool.digest``). Arguments are digested as the JSON values they are (``1``
and ``1.0`` differ, as they do on the wire), so a request keeps them as exact text
(``core.storage.models.ExactJson``): read back, they digest the same.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

MAX_REPORTED_ERRORS = 3
MAX_ERROR_CHARS = 300


def canonical_json(value: Any) -> str:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def call_digest(
    name: str, arguments: dict[str, Any], *, tool: Mapping[str, str] | None = None
) -> str:
    """The hex SHA-256 that names this call and no other: the name the model called, the
    arguments, and (``tool``) what answers that name, so an approval never carries over to a
    server that was moved or to another tool behind the same offered name."""
    named: dict[str, Any] = {"name": name, "arguments": arguments}
    if tool is not None:
        named["tool"] = dict(tool)
    return hashlib.sha256(canonical_json(named).encode("utf-8")).hexdigest()


class ArgumentCheck:
    """A tool's input schema, compiled once, checking the model's arguments before a call.

    A schema the validator cannot use (invalid, or ``$ref`` to somewhere it will not fetch)
    checks nothing: the server still validates, and refusing every call over its schema's
    quirk would take a working tool away.
    """

    def __init__(self, schema: dict[str, Any]) -> None:
        from jsonschema.exceptions import SchemaError
        from jsonschema.validators import Draft202012Validator, validator_for

        self._validator: Validator | None
        try:
            cls = validator_for(schema, default=Draft202012Validator)
            cls.check_schema(schema)
            self._validator = cls(schema)
        except (SchemaError, TypeError, ValueError, LookupError):
            self._validator = None

    def problem(self, arguments: object) -> str | None:
        """What is wrong with ``arguments`` (one line, for the model to correct), or None."""
        if not isinstance(arguments, dict):
            return "the arguments must be a JSON object"
        if self._validator is None:
            return None
        from jsonschema.exceptions import relevance

        try:
            errors = sorted(self._validator.iter_errors(arguments), key=relevance, reverse=True)
        except Exception:  # an unresolvable $ref surfaces only while validating
            return None
        if not errors:
            return None
        parts = []
        for error in errors[:MAX_REPORTED_ERRORS]:
            where = "/".join(str(p) for p in error.absolute_path) or "arguments"
            parts.append(f"{where}: {error.message}"[:MAX_ERROR_CHARS])
        more = len(errors) - MAX_REPORTED_ERRORS
        return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")
