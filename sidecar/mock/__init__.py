"""Simulated OpenEngine engines: TensorRT-LLM, vLLM and SGLang flavours (issue 3).

asyncio programs built on the generated grpclib bases through
:mod:`sidecar.openengine.server`. Start one with ``openengine-sidecar mock-engine``
(:mod:`.command`), from trio code with :func:`.testing.run_mock_engine` (subprocess) or
:func:`.testing.mock_engine_in_process`, or from asyncio with :func:`.app.serve_engine`.

Modules:

- :mod:`.config` (``EngineConfig``), :mod:`.faults` (``--fault`` switches),
  :mod:`.flavors` (per-flavour discovery), :mod:`.schemas` (the OpenEngine schema an
  engine is built on: ``--schema a66ff6f|4def7c5|31be5db``, ``--release-form``);
- :mod:`.tokenizer` (documented vocabulary), :mod:`.generator` (seeded tokens, stop
  rules, logprobs), :mod:`.validation` (checks before acceptance),
  :mod:`.scheduler` (admission), :mod:`.lora`, :mod:`.counters` (ground truth in
  ``GetLoad.attributes``) — all I/O-free;
- :mod:`.engine` (state, Abort, Health, GetLoad), :mod:`.runner` (one request's
  stream), :mod:`.drain`, :mod:`.events` (responses, fast-mode pre-encoding),
  :mod:`.services` (gRPC surface), :mod:`.app` (wiring);
- KV: :mod:`.kvcache`, :mod:`.kvevents` (ZMQ), :mod:`.kvevents_grpc`
  (``SubscribeKvEvents``), :mod:`.kvevents_wire`, :mod:`.kvevents_model`,
  :mod:`.transfer` (prefill → decode handoff).
"""
