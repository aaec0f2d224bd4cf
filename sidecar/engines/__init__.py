"""Adapters that put a stock inference engine behind an OpenEngine v1 server (optional extras).

``sidecar/engines/vllm/`` serves stock vLLM (the ``vllm`` extra), ``sidecar/engines/sglang/``
stock SGLang (the ``sglang`` extra), both on ``sidecar/engines/common/`` (what no engine owns:
registry, Abort, Drain, the services, request checks, stream rules; docs/ENGINES.md). Each
adapter is the only code importing its engine; the sidecar itself never imports them.
"""
