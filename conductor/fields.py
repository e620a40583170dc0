"""Output fields of a job: their types, the JSON Schema built from them, and the
Arrow type each becomes in records.parquet.

The schema sent to providers is "strict"-shaped (every property listed as
required, optional ones nullable, no extra properties), which is what OpenAI's
structured outputs accept; replies are validated against the same schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

TYPES = ("string", "number", "integer", "boolean", "enum", "date", "list", "object")
ITEM_TYPES = ("string", "number", "integer", "boolean")
_JSON_TYPE = {"string": "string", "number": "number", "integer": "integer", "boolean": "boolean",
              "date": "string", "list": "array", "object": "object"}
_ARROW = {"string": pa.string(), "number": pa.float64(), "integer": pa.int64(), "boolean": pa.bool_(),
          "enum": pa.string(), "date": pa.date32()}


@dataclass(frozen=True)
class Field:
    name: str
    type: str
    description: str = ""
    required: bool = False
    values: tuple[Any, ...] = ()  # enum
    items: str = "string"  # list
    fields: tuple["Field", ...] = field(default_factory=tuple)  # object

    def json_schema(self, nullable: bool) -> dict[str, Any]:
        if self.type == "enum":
            # A type beside the enum: strict structured-output modes ask for one.
            t = _enum_type(self.values)
            s: dict[str, Any] = {"enum": list(self.values) + ([None] if nullable else [])}
            if t:
                s["type"] = [t, "null"] if nullable else t
        elif self.type == "list":
            s = {"type": ["array", "null"] if nullable else "array", "items": {"type": self.items}}
        elif self.type == "object":
            s = object_schema(self.fields, strict=True)
            if nullable:
                s["type"] = ["object", "null"]
        else:
            t = _JSON_TYPE[self.type]
            s = {"type": [t, "null"] if nullable else t}
            if self.type == "date":
                s["format"] = "date"
        if self.description:
            s["description"] = self.description
        return s

    def arrow_type(self) -> pa.DataType:
        if self.type == "list":
            return pa.list_(_ARROW[self.items])
        if self.type == "object":
            return pa.struct([pa.field(f.name, f.arrow_type()) for f in self.fields])
        return _ARROW[self.type]


def _enum_type(values: tuple[Any, ...]) -> str | None:
    for name, kind in (("boolean", bool), ("string", str), ("integer", int), ("number", (int, float))):
        if all(isinstance(v, kind) and (kind is bool or not isinstance(v, bool)) for v in values):
            return name
    return None


def object_schema(fields: tuple[Field, ...], strict: bool) -> dict[str, Any]:
    """`strict`: the wire shape (all listed, optional ones nullable); else the validation
    shape (only required ones listed; optional ones may also be null)."""
    return {
        "type": "object",
        "properties": {f.name: f.json_schema(nullable=not f.required) for f in fields},
        "required": [f.name for f in fields if strict or f.required],
        "additionalProperties": False,
    }


def arrow_schema(fields: tuple[Field, ...]) -> pa.Schema:
    return pa.schema([pa.field(f.name, f.arrow_type()) for f in fields])
