"""Wait until a URL answers 200: `python scripts/wait_http.py URL [TIMEOUT_S] [PID]`; exit 1 on timeout, or as
soon as process PID (the server being waited for) has exited: a refused configuration ends the wait at once."""
import os
import sys
import time
import urllib.request


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a child that exited but was not reaped yet is a zombie: gone for this purpose
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


url, timeout = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 120.0
pid = int(sys.argv[3]) if len(sys.argv) > 3 else None
deadline = time.time() + timeout
while time.time() < deadline:
    try:
        if urllib.request.urlopen(url, timeout=2).status == 200:
            sys.exit(0)
    except Exception:
        pass
    if pid is not None and not alive(pid):
        print(f"the server (pid {pid}) exited before {url} answered 200", file=sys.stderr)
        sys.exit(1)
    time.sleep(0.5)
print(f"{url} did not answer 200 within {timeout:.0f}s", file=sys.stderr)
sys.exit(1)
