"""Adapters that put a stock inference engine behind an OpenEngine v1 server (optional extras).

``sidecar/engines/vllm/`` serves stock vLLM (the ``vllm`` extra, docs/ENGINES.md). Each adapter is
the only code importing its engine; the sidecar itself never imports them.
"""
