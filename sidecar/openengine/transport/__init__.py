"""The engine transport: HTTP/2 framing (:mod:`.http2`), gRPC's message framing and statuses
(:mod:`.grpc_framing`), one connection carrying calls (:mod:`.connection`), and a pool of
connections (:mod:`.pool`). trio-native and I/O-free below :mod:`.connection`."""
