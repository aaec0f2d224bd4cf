"""The static type of JSON data: what ``json.loads`` returns and what a JSON encoder takes.

:data:`JSONValue` is recursive; :data:`JSONObject` is a JSON object. They describe values
built or returned by the sidecar (proto3 JSON of messages, JSON Schemas, a ``Struct`` as
Python values). A value decoded from a client is typed ``object`` until it is checked: a
msgpack frame may also carry ``bin`` (bytes) where JSON has none.

Type aliases only: msgspec cannot decode into a recursive alias on Python 3.11, so a msgspec
Struct field holding arbitrary JSON is typed ``object`` or ``Any`` (msgspec decodes both
alike); ``object`` makes its readers narrow it with ``isinstance``.
"""

from __future__ import annotations

from typing import TypeAlias

__all__ = ["JSONObject", "JSONValue"]

JSONValue: TypeAlias = bool | int | float | str | list["JSONValue"] | dict[str, "JSONValue"] | None
JSONObject: TypeAlias = dict[str, JSONValue]
