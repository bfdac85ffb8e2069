"""Wait until a URL answers 200: `python scripts/wait_http.py URL [TIMEOUT_S]`; exit 1 on timeout."""
import sys
import time
import urllib.request

url, timeout = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 120.0
deadline = time.time() + timeout
while time.time() < deadline:
    try:
        if urllib.request.urlopen(url, timeout=2).status == 200:
            sys.exit(0)
    except Exception:
        pass
    time.sleep(0.5)
print(f"{url} did not answer 200 within {timeout:.0f}s", file=sys.stderr)
sys.exit(1)
