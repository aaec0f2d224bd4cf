"""The OpenEngine layer: generated bindings and the sidecar's only door to the engine.

Everything above this package sees trio-native calls and streams (``client``) and plain
protobuf messages (``pb``). It is the only production code that imports grpclib: the
simulated engines (``sidecar.mock``) serve with it through ``server`` and are asyncio
programs of their own, the benchmark patches it in its engine process, and the Dynamo plane
is a second trio<->asyncio boundary (``sidecar.dynamo``).
"""
