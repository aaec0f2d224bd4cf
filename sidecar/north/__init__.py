"""The north side: the WebSocket protocol v1 (wire messages, codec, proto3 JSON mapping) and its server."""
