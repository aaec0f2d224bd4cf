"""The OpenEngine layer: generated bindings and the only asyncio/grpclib code in the sidecar.

Everything above this package sees trio-native calls and streams (``client``) and plain
protobuf messages (``pb``).
"""
