"""The sidecar's core: what it decides about an engine and its streams.

Two kinds of module live here. The rules are I/O-free functions and classes over ``pb``
messages that tests call directly: negotiation, the worker card, admission, metadata, handoff
and load parsing. The trio services built on them own the I/O: :mod:`sidecar.core.lifecycle`
(every stream's life and its Abort), :mod:`sidecar.core.sidecar` (startup, engine watch, load
polling, drain) and :mod:`sidecar.core.discovery` (the discovery calls); ``describe_command``
is a CLI shell around them.
"""
