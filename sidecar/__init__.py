"""openengine-sidecar: an engine-neutral trio sidecar for OpenEngine v1 engines."""

__version__ = "0.1.0"
