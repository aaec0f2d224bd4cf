"""The OpenAI-compatible front (``run --openai-listen``): Completions, Chat Completions, Models,
and the model-server metrics of the Gateway API Inference Extension (docs/OPENAI.md).

Modules: ``protocol`` (the request bodies, decoded and bounded), ``request_map`` (a request →
``GenerateRequest`` + metadata, through ``sidecar.core.request_options``), ``chat_templates``
(the model's template, rendered in a sandbox), ``responses`` (engine events → response bodies
and SSE chunks), ``api_errors`` (OpenAI's error objects and statuses), ``gie_metrics`` (the
``vllm:*`` gauges), ``routes`` (the ASGI app: the same admission and stream lifecycle as the
WebSocket plane, ``Sidecar.admit`` / ``Sidecar.run_stream``).
"""
