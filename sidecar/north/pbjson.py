"""Proto3 JSON mapping for the betterproto2 OpenEngine messages, strict on input.

The north protocol embeds OpenEngine messages in their proto3 JSON form
(https://protobuf.dev/programming-guides/json/): lowerCamelCase names (the
original snake_case names are accepted too), 64-bit integers as decimal strings,
enums by name, bytes as base64, ``NaN``/``Infinity``/``-Infinity`` as strings.
msgpack frames carry the same shapes, except that a bytes field may also be a
msgpack ``bin``.

``message_from_json`` is stricter than betterproto2's ``from_dict`` (which
accepts a number for a string field, truncates ``1.5`` into an integer field,
ignores base64 garbage and lets two members of a oneof through) and about twice
as fast. ``message_to_json`` is the generic encoder for the cold paths (call
results, the KV session of a ``prefillReady``); the per-token path builds msgspec
Structs directly (``sidecar.north.codec``).

Errors: every input problem raises ``PbJsonError`` with a dotted path.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import betterproto2
from betterproto2 import casing

from sidecar.json_types import JSONObject, JSONValue
from sidecar.openengine import pb
from sidecar.openengine.schema._betterproto2_internals import Field
from sidecar.openengine.schema._betterproto2_internals import fields as message_fields
from sidecar.quoting import quote

__all__ = [
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "PbJsonError",
    "decode_base64",
    "message_from_json",
    "message_to_json",
]

M = TypeVar("M", bound=betterproto2.Message)

#: Deepest nesting of messages / Struct values accepted on input.
MAX_DEPTH = 32

_INT_RANGES: dict[str, tuple[int, int]] = {
    betterproto2.TYPE_INT32: (-(2**31), 2**31 - 1),
    betterproto2.TYPE_SINT32: (-(2**31), 2**31 - 1),
    betterproto2.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    betterproto2.TYPE_UINT32: (0, 2**32 - 1),
    betterproto2.TYPE_FIXED32: (0, 2**32 - 1),
    betterproto2.TYPE_INT64: (-(2**63), 2**63 - 1),
    betterproto2.TYPE_SINT64: (-(2**63), 2**63 - 1),
    betterproto2.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    betterproto2.TYPE_UINT64: (0, 2**64 - 1),
    betterproto2.TYPE_FIXED64: (0, 2**64 - 1),
}
_INT64_TYPES = frozenset(
    {
        betterproto2.TYPE_INT64,
        betterproto2.TYPE_SINT64,
        betterproto2.TYPE_SFIXED64,
        betterproto2.TYPE_UINT64,
        betterproto2.TYPE_FIXED64,
    }
)
_FLOAT32_MAX = 3.4028234663852886e38
#: An integer as a decimal string: at most 20 digits (a uint64 has 20; Python refuses to convert
#: more than 4,300 and costs quadratic time below that).
MAX_INT_DIGITS = 20
_INT_STRING = re.compile(rf"-?[0-9]{{1,{MAX_INT_DIGITS}}}")
_SPECIAL_FLOATS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class PbJsonError(ValueError):
    """A value does not follow the proto3 JSON mapping of its message; ``str()`` names the field path."""


def _fail(path: str, message: str) -> PbJsonError:
    return PbJsonError(f"{path}: {message}" if path else message)


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bytes | bytearray):
        return "bytes"
    if isinstance(value, list | tuple):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def decode_base64(value: str) -> bytes:
    """Decode standard or URL-safe base64, padding optional (proto3 JSON); ``ValueError`` on garbage."""
    if "-" in value or "_" in value:
        value = value.replace("-", "+").replace("_", "/")
    missing = -len(value) % 4
    if missing == 3:
        raise ValueError("invalid base64 length")
    try:
        return base64.b64decode(value + "=" * missing, validate=True)
    except binascii.Error as err:
        raise ValueError(f"invalid base64 ({err})") from None


# --- scalar readers: (value, path, depth) -> python value ------------------------------------------

#: A reader checks a decoded value (anything a JSON or msgpack decoder returns) and converts it.
_Reader = Callable[[object, str, int], object]
#: A writer converts a field's value to its proto3 JSON form. Its parameter is left untyped: its
#: type is the field's, different for each field, and each plan entry pairs a field with its writer.
_Writer = Callable[[Any], JSONValue]


def _read_string(value: object, path: str, depth: int) -> str:
    if type(value) is not str:
        raise _fail(path, f"expected a string, got {_kind(value)}")
    return value


def _read_bool(value: object, path: str, depth: int) -> bool:
    if type(value) is not bool:
        raise _fail(path, f"expected a boolean, got {_kind(value)}")
    return value


def _int_reader(proto_type: str) -> _Reader:
    lo, hi = _INT_RANGES[proto_type]

    def read(value: object, path: str, depth: int) -> int:
        if type(value) is int:
            result = value
        elif (type(value) is str and _INT_STRING.fullmatch(value)) or (
            type(value) is float and value.is_integer()
        ):
            result = int(value)
        else:
            raise _fail(
                path,
                f"expected an integer (number or decimal string of at most {MAX_INT_DIGITS} digits),"
                f" got {_kind(value)}",
            )
        if not lo <= result <= hi:
            raise _fail(path, f"{result} is out of range for {proto_type}")
        return result

    return read


def _float_reader(proto_type: str) -> _Reader:
    limit = _FLOAT32_MAX if proto_type == betterproto2.TYPE_FLOAT else math.inf

    def read(value: object, path: str, depth: int) -> float:
        if type(value) is float or type(value) is int:
            result = float(value)
        elif type(value) is str:
            special = _SPECIAL_FLOATS.get(value)
            if special is not None:
                return special
            try:
                result = float(value)
            except ValueError:
                raise _fail(path, f"expected a number, got string {value[:40]!r}") from None
            if not math.isfinite(result):
                raise _fail(path, f"expected a number, got string {value[:40]!r}")
        else:
            raise _fail(path, f"expected a number, got {_kind(value)}")
        if abs(result) > limit:
            raise _fail(path, f"{result} is out of range for {proto_type}")
        return result

    return read


def _read_bytes(value: object, path: str, depth: int) -> bytes:
    if type(value) is str:
        try:
            return decode_base64(value)
        except ValueError as err:
            raise _fail(path, str(err)) from None
    if isinstance(value, bytes | bytearray):  # msgpack bin
        return bytes(value)
    raise _fail(path, f"expected base64 bytes, got {_kind(value)}")


def _enum_reader(enum_cls: type[betterproto2.Enum]) -> _Reader:
    by_name = {member.proto_name or member.name: member for member in enum_cls}

    def read(value: object, path: str, depth: int) -> betterproto2.Enum:
        if type(value) is str:
            member = by_name.get(value)
            if member is None:
                raise _fail(path, f"unknown {enum_cls.__name__} value {value[:60]!r}")
            return member
        if type(value) is int and -(2**31) <= value < 2**31:
            return enum_cls(value)  # open enum: unknown numbers are kept (proto3)
        raise _fail(path, f"expected an enum name, got {_kind(value)}")

    return read


# --- google.protobuf.Struct / Value / ListValue ------------------------------------------------------


def _to_value(value: object, path: str, depth: int) -> pb.Value:
    if depth > MAX_DEPTH:
        raise _fail(path, f"nested deeper than {MAX_DEPTH}")
    if value is None:
        return pb.Value(null_value=pb.NullValue.NULL_VALUE)
    if type(value) is bool:
        return pb.Value(bool_value=value)
    if type(value) is int or type(value) is float:
        if not math.isfinite(value):
            raise _fail(path, "Struct numbers must be finite")
        return pb.Value(number_value=float(value))
    if type(value) is str:
        return pb.Value(string_value=value)
    if type(value) is list:
        return pb.Value(list_value=_to_list_value(value, path, depth))
    if type(value) is dict:
        return pb.Value(struct_value=_to_struct(value, path, depth))
    raise _fail(path, f"{_kind(value)} is not a JSON value")


def _to_list_value(value: object, path: str, depth: int) -> pb.ListValue:
    if type(value) is not list:
        raise _fail(path, f"expected an array, got {_kind(value)}")
    return pb.ListValue(values=[_to_value(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)])


def _to_struct(value: object, path: str, depth: int) -> pb.Struct:
    if type(value) is not dict:
        raise _fail(path, f"expected an object, got {_kind(value)}")
    fields = {}
    for key, item in value.items():
        if type(key) is not str:
            raise _fail(path, f"object keys must be strings, got {_kind(key)}")
        fields[key] = _to_value(item, f"{path}.{key}", depth + 1)
    return pb.Struct(fields=fields)


_WELL_KNOWN_READERS: dict[type, _Reader] = {
    pb.Struct: _to_struct,
    pb.Value: _to_value,
    pb.ListValue: _to_list_value,
}


def _value_to_python(value: pb.Value) -> JSONValue:
    if value.string_value is not None:
        return value.string_value
    if value.number_value is not None:
        return _float_out(value.number_value)
    if value.bool_value is not None:
        return value.bool_value
    if value.struct_value is not None:
        return _struct_to_python(value.struct_value)
    if value.list_value is not None:
        return [_value_to_python(v) for v in value.list_value.values]
    return None


def _struct_to_python(value: pb.Struct) -> JSONObject:
    return {k: _value_to_python(v) for k, v in value.fields.items()}


_WELL_KNOWN_WRITERS: dict[type, _Writer] = {
    pb.Struct: _struct_to_python,
    pb.Value: _value_to_python,
    pb.ListValue: lambda v: [_value_to_python(x) for x in v.values],
}


# --- per-message plans ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Field:
    attr: str
    json_name: str
    proto_type: str
    repeated: bool
    presence: bool  # proto3 optional, oneof member or message: emitted when set, even if zero
    group: str | None
    read: _Reader  # one element (repeated) / one value
    write: _Writer | None  # None: value is JSON-ready as is
    default: object
    map_key: _Reader | None = None


def _float_out(value: float) -> float | str:
    if -math.inf < value < math.inf:
        return value
    return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")


def _map_key_reader(proto_type: str) -> _Reader:
    if proto_type == betterproto2.TYPE_STRING:
        return _read_string
    if proto_type == betterproto2.TYPE_BOOL:

        def read_bool_key(value: object, path: str, depth: int) -> bool:
            if value == "true":
                return True
            if value == "false":
                return False
            raise _fail(path, f"expected a boolean map key, got {quote(value)}")

        return read_bool_key
    return _int_reader(proto_type)


class _Plan:
    """How to read and write one message class (built once per class, on first use)."""

    def __init__(self, cls: type[betterproto2.Message]) -> None:
        self.cls = cls
        self.by_key: dict[str, _Field] = {}
        self.fields: list[_Field] = []
        for f in message_fields(cls):
            attr = f.name
            json_name = casing.camel_case(attr.rstrip("_"))
            read, write, map_key = self._converters(f)
            assert f.default is not None
            entry = _Field(
                attr=attr,
                json_name=json_name,
                proto_type=f.proto_type,
                repeated=f.repeated,
                presence=f.optional,
                group=f.group,
                read=read,
                write=write,
                default=f.default(),
                map_key=map_key,
            )
            self.fields.append(entry)
            self.by_key[json_name] = entry
            self.by_key[attr.rstrip("_")] = entry

    @staticmethod
    def _converters(f: Field) -> tuple[_Reader, _Writer | None, _Reader | None]:
        proto_type, field_cls = f.proto_type, f.cls
        if f.map_value is not None and f.map_key_type is not None:
            read, write, _ = _Plan._converters(f.map_value)
            return read, write, _map_key_reader(f.map_key_type)
        if proto_type == betterproto2.TYPE_MESSAGE:
            if field_cls in _WELL_KNOWN_READERS:
                return _WELL_KNOWN_READERS[field_cls], _WELL_KNOWN_WRITERS[field_cls], None

            def read_message(value: object, path: str, depth: int) -> betterproto2.Message:
                return _read_message(field_cls, value, path, depth + 1)

            return read_message, message_to_json, None
        if proto_type == betterproto2.TYPE_STRING:
            return _read_string, None, None
        if proto_type == betterproto2.TYPE_BOOL:
            return _read_bool, None, None
        if proto_type == betterproto2.TYPE_BYTES:
            return _read_bytes, lambda b: base64.b64encode(b).decode("ascii"), None
        if proto_type == betterproto2.TYPE_ENUM:
            names = {m.value: m.proto_name or m.name for m in field_cls}  # type: ignore[attr-defined]
            return _enum_reader(field_cls), lambda v: names.get(int(v), int(v)), None
        if proto_type in (betterproto2.TYPE_FLOAT, betterproto2.TYPE_DOUBLE):
            return _float_reader(proto_type), _float_out, None
        if proto_type in _INT64_TYPES:
            return _int_reader(proto_type), str, None
        return _int_reader(proto_type), None, None


_PLANS: dict[type, _Plan] = {}


def _plan(cls: type[betterproto2.Message]) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = _Plan(cls)
    return plan


def _read_message(cls: type[M], value: object, path: str, depth: int) -> M:
    if depth > MAX_DEPTH:
        raise _fail(path, f"nested deeper than {MAX_DEPTH}")
    if not isinstance(value, dict):
        raise _fail(path, f"expected an object, got {_kind(value)}")
    plan = _plan(cls)
    kwargs: dict[str, object] = {}
    groups: dict[str, str] | None = None
    for key, item in value.items():
        field = plan.by_key.get(key) if type(key) is str else None
        if field is None:
            raise _fail(path, f"unknown field {str(key)[:60]!r} in {cls.__name__}")
        if item is None:  # proto3 JSON: null is the default value
            continue
        fpath = f"{path}.{field.json_name}" if path else field.json_name
        if field.attr in kwargs:
            raise _fail(fpath, "field given twice (camelCase and snake_case)")
        if field.group is not None:
            if groups is None:
                groups = {}
            other = groups.get(field.group)
            if other is not None:
                raise _fail(fpath, f"oneof '{field.group}' already set by {other!r}")
            groups[field.group] = field.json_name
        if field.map_key is not None:
            if type(item) is not dict:
                raise _fail(fpath, f"expected an object, got {_kind(item)}")
            kwargs[field.attr] = {
                field.map_key(k, fpath, depth): field.read(v, f"{fpath}.{k}", depth) for k, v in item.items()
            }
        elif field.repeated:
            if type(item) is not list:
                raise _fail(fpath, f"expected an array, got {_kind(item)}")
            read = field.read
            kwargs[field.attr] = [read(v, f"{fpath}[{i}]", depth) for i, v in enumerate(item)]
        else:
            kwargs[field.attr] = field.read(item, fpath, depth)
    return cls(**kwargs)


def message_from_json(cls: type[M], value: object, *, path: str = "") -> M:
    """Build a ``cls`` message from its proto3 JSON form (as decoded from JSON or msgpack).

    Unknown fields, ill-typed values, out-of-range numbers, unknown enum names, invalid
    base64, two members of one oneof and nesting deeper than ``MAX_DEPTH`` raise
    ``PbJsonError`` (its message starts with the dotted ``path``).
    """
    well_known = _WELL_KNOWN_READERS.get(cls)
    if well_known is not None:
        return cast(M, well_known(value, path, 0))  # the reader of cls builds a cls
    return _read_message(cls, value, path, 0)


def message_to_json(msg: betterproto2.Message) -> JSONObject:
    """The proto3 JSON form of ``msg`` as plain Python values (ready for msgspec JSON or msgpack).

    Default values are omitted except where the field has presence (proto3 ``optional``,
    oneof members, messages); 64-bit integers become strings, enums their names (unknown
    numbers stay numbers), bytes base64, non-finite floats ``"NaN"``/``"Infinity"``.
    Unknown fields are not representable in JSON and are dropped. A ``Struct`` is its object;
    a ``Value`` or ``ListValue`` (not an object) raises ``TypeError``: those are written as fields.
    """
    cls = type(msg)
    writer = _WELL_KNOWN_WRITERS.get(cls)
    if writer is not None:
        written = writer(msg)
        if not isinstance(written, dict):  # a Value or ListValue: write it as a field, not alone
            raise TypeError(f"the proto3 JSON form of a {cls.__name__} is not an object")
        return written
    out: JSONObject = {}
    for field in _plan(cls).fields:
        value = getattr(msg, field.attr)
        if value is None:
            continue
        write = field.write
        if field.map_key is not None:
            if value:
                out[field.json_name] = {
                    (str(k).lower() if type(k) is bool else str(k)): (write(v) if write else v)
                    for k, v in value.items()
                }
        elif field.repeated:
            if value:
                out[field.json_name] = [write(v) for v in value] if write else list(value)
        elif field.presence or value != field.default:
            out[field.json_name] = write(value) if write else value
    return out
