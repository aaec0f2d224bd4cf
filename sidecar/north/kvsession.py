"""KvSessionRef bytes a client hands over (``kvSessionBytes``): validation and byte-exact splicing.

The decode engine must receive the prefill engine's ``KvSessionRef`` exactly as produced --
field order, unknown fields (a newer schema revision) and all. Re-serializing a parsed copy
would not guarantee that, so ``splice_kv_session`` keeps the raw bytes in ``KvOptions``'
unknown-field buffer, which betterproto2 writes out verbatim. ``parse_kv_session`` checks the
bytes first, because betterproto2's parser accepts malformed input silently.
"""

from __future__ import annotations

import copy

from sidecar.openengine import pb
from sidecar.openengine._betterproto2_internals import set_unknown_fields
from sidecar.openengine.rawfields import length_delimited, parse_strict

__all__ = ["parse_kv_session", "splice_kv_session"]


def parse_kv_session(raw: bytes) -> pb.KvSessionRef:
    """Check ``raw`` is a well-formed ``KvSessionRef`` (framing, known fields' wire types, UTF-8
    strings) and return its parsed form (for admission checks). Raises ``WireError`` (a ``ValueError``)."""
    return parse_strict(pb.KvSessionRef, raw)


def splice_kv_session(request: pb.GenerateRequest, raw: bytes) -> pb.GenerateRequest:
    """A shallow copy of ``request`` whose ``kv.session`` is ``raw``, byte for byte.

    The bytes become field 1 (``session``) of ``KvOptions``, held in that message's unknown-field
    buffer: ``bytes()`` emits them untouched after the other ``KvOptions`` fields, as a single
    occurrence of the field (no reliance on protobuf's merging of repeated message fields).
    ``request`` itself is not modified.
    """
    out = copy.copy(request)
    kv = copy.copy(request.kv) if request.kv is not None else pb.KvOptions()
    kv.session = None
    set_unknown_fields(kv, length_delimited(1, raw))  # field 1 (session)
    out.kv = kv
    return out
