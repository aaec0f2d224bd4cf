"""I/O-free core of the sidecar: negotiation, the worker card, admission, metadata and handoff rules.

Everything here except :mod:`sidecar.core.discovery` (which awaits an ``EngineClient``) and
:mod:`sidecar.core.describe_command` (a CLI shell) is plain functions and classes over
``pb`` messages, so tests call them directly.
"""
