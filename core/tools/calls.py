"""One exact tool call: its digest (what an approval binds to) and its arguments' check.

The digest is the SHA-256 of the canonical JSON of ``{"name", "arguments"}``: keys sorted, no
spaces, UTF-8, no NaN. Arguments are digested as the JSON values they are (``1`` and ``1.0``
differ, as they do on the wire), so a request stored as JSON and read back digests the same.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

MAX_REPORTED_ERRORS = 3
MAX_ERROR_CHARS = 300


def canonical_json(value: Any) -> str:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def call_digest(name: str, arguments: dict[str, Any]) -> str:
    """The hex SHA-256 that names this call and no other (tool name and arguments)."""
    payload = canonical_json({"name": name, "arguments": arguments})
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


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
