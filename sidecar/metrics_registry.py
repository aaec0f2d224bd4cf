"""The sidecar's Prometheus registry.

Every component registers its metric families on :data:`REGISTRY` (not the process-global
default registry), and ``/metrics`` renders exactly this registry.
"""

from prometheus_client import CollectorRegistry

REGISTRY = CollectorRegistry(auto_describe=True)
