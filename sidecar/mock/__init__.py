"""Simulated OpenEngine engines: TensorRT-LLM, vLLM and SGLang flavours.

asyncio programs built on the generated grpclib bases through
:mod:`sidecar.openengine.serving.grpc_server`. Start one with ``openengine-sidecar mock-engine``
(:mod:`.command`), from trio code with :func:`.testing.run_mock_engine` (subprocess) or
:func:`.testing.mock_engine_in_process`, or from asyncio with :func:`.app.serve_engine`.

Concurrency: asyncio's structured forms (Python 3.11) — ``asyncio.TaskGroup`` for tasks
that live together (the engine's holders of leaked requests in :meth:`.engine.MockEngine.serving`,
an Abort racing a KV handoff in :mod:`.runner`, the ZMQ publishers), ``asyncio.timeout``
for bounded waits; a request waits in one place, :meth:`.engine.Request.wait_woken` (a pause
that an Abort or a free slot ends early; a timer handle like ``asyncio.sleep``'s, measured
cheaper per token than ``asyncio.timeout``). asyncio, not
trio, because the engine is served by grpclib (:mod:`sidecar.openengine.serving.grpc_server`), an asyncio
library, as a real engine's server is: its handlers are asyncio tasks, and trio would put a
trio-asyncio hop on every event the engine sends. Left as they are, each for its reason:
the ZMQ publishers' group is owned by one service task that :class:`.kvevents.ZmqKvEvents`
cancels and awaits on close (tests enter and leave it through trio-asyncio, in two asyncio
tasks, and a group must be left by the task that opened it);
asyncio's stream server starts a task per KV-transfer connection (:mod:`.transfer` cancels
and awaits them on close), a held KV session expires by a timer handle (data with a
deadline, not an activity), ZMQ sends complete by callback (``publish`` is synchronous).

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
