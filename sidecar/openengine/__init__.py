"""The OpenEngine layer: the schema's bindings and the sidecar's only door to the engine.

Laid out by role:

- the client API, at the top: :mod:`.client` (``EngineClient``, ``EngineStream``,
  ``open_engine_client``), :mod:`.engine_errors` (its typed errors), :mod:`.stream_rules` (the
  server-stream rules every stream is checked against), :mod:`.message_limits` (what it takes
  from the engine), :mod:`.address` (engine addresses); :mod:`.pb` for the messages;
- :mod:`.schema` — the schema's messages as bytes: hand-written codecs of the hot messages, the
  strict wire reading, betterproto2's internals; the generated bindings are ``_generated/``;
- :mod:`.transport` — one trio-native HTTP/2 transport for every call: our client side of
  HTTP/2's framing, gRPC's message framing and statuses, a connection, a pool of them;
- :mod:`.releases` — the schema releases and revisions this build speaks and knows;
- :mod:`.serving` — a grpclib serving kit for the asyncio programs that *serve* OpenEngine (the
  simulated engines, the engine adapters); the sidecar's own client never uses grpclib.

Everything above this package sees trio-native calls and streams and plain protobuf messages.
"""
