#!/usr/bin/env python3
"""Container HEALTHCHECK: GET /health on the sidecar's HTTP listener; exit 0 when it answers 200.

The port comes from OPENENGINE_SIDECAR_HTTP_LISTEN (the same variable `run` reads, default
127.0.0.1:8601); a wildcard bind host is probed on loopback. With --tls-cert the listener
speaks HTTPS and the probe does too (the certificate is not verified: this is a liveness
probe of the local process, not a client).
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.request

DEFAULT = "127.0.0.1:8601"


def url() -> str:
    host, _, port = os.environ.get("OPENENGINE_SIDECAR_HTTP_LISTEN", DEFAULT).rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if os.environ.get("OPENENGINE_SIDECAR_TLS_CERT") else "http"
    return f"{scheme}://{host}:{port}/health"


def main() -> int:
    context = ssl._create_unverified_context()  # local liveness probe: no verification
    try:
        with urllib.request.urlopen(url(), timeout=3, context=context) as response:
            return 0 if response.status == 200 else 1
    except OSError as err:
        print(f"healthcheck: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
