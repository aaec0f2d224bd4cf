"""Serving OpenEngine from an asyncio program (the simulated engines, engine adapters): a grpclib
serving kit (:mod:`.grpc_server`) and the one module touching grpclib's internals."""
