"""Container healthcheck: GET $FEDSPLIT_HEALTH_URL (2xx = healthy), TLS-verified against
$FEDSPLIT_HEALTH_CA when set. Without a URL it checks that fedsplit imports."""

from __future__ import annotations

import os
import ssl
import sys
import urllib.request


def main() -> int:
    """Return 0 when healthy, 1 otherwise (Docker's healthcheck contract)."""
    url = os.environ.get("FEDSPLIT_HEALTH_URL")
    if not url:
        from fedsplit import cli  # noqa: F401  (the package is installed and importable)

        return 0
    ca = os.environ.get("FEDSPLIT_HEALTH_CA")
    context = ssl.create_default_context(cafile=ca) if ca else None
    try:
        with urllib.request.urlopen(url, timeout=4, context=context) as response:
            return 0 if 200 <= response.status < 300 else 1
    except OSError as e:
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
