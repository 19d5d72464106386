"""Container health check: the balena engine restarts an unhealthy container, as systemd's watchdog would.

Unhealthy when /healthz does not answer 200 (process wedged or stopping), or when it
reports a pipeline stall that is not explained by the camera being reopened: the same
rule under which the node stops its systemd watchdog pings.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    # The same variable that sets [service] http_port (edgerun/config_env.py); 8089 is node.toml's.
    port = os.environ.get("EDGERUN_SERVICE_HTTP_PORT", "8089")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=4) as resp:
            body = json.load(resp)
    except (OSError, ValueError) as err:  # HTTPError (503), refused, timeout, bad JSON
        print(f"unhealthy: {err}")
        return 1
    reasons = body.get("reasons", {})
    if "pipeline" in reasons and "source" not in reasons:
        print(f"unhealthy: {reasons['pipeline']}")
        return 1
    print(body.get("state", "?"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
