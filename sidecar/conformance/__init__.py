"""Engine conformance suite (``openengine-sidecar conformance``, docs/CONFORMANCE.md).

Each check drives a live engine through one OpenEngine rule and reports pass, fail or
skip (with the reason). Layout: :mod:`.model` (checks, results, selection),
:mod:`.streams` (I/O-free stream-rule analysis), :mod:`.context` (clients, discovery
cache, request helpers), ``checks_*`` (the checks, one module per area), :mod:`.runner`,
:mod:`.report`, :mod:`.progress` and :mod:`.command`.
"""
