"""Heartbeat registration from a background thread: a prefill/decode instance registers with its
pd_master (a fixed URL, or every master a config server lists), a pd_master with the config server.

One POST per target per interval carries the current load; a target that stops answering is retried
every interval. Failures never leave the thread and are logged once per change of state.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Mapping, Optional

import httpx

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "master")
LoadFn = Callable[[], Mapping[str, Any]]  # -> {"running": int, "waiting": int, "kv_used": float}


class Registrar:
    def __init__(self, role: str, instance_id: str, url: str, kv_address: Optional[str], model: str,
                 load_fn: LoadFn, master_url: Optional[str] = None, config_server_url: Optional[str] = None,
                 interval_s: float = 1.0, extra: Optional[Mapping[str, Any]] = None):
        """role "prefill"/"decode": heartbeats to `master_url`'s /pd/register, or, given only
        `config_server_url`, to every master the config server lists (and to the config server itself).
        role "master": heartbeats to the config server's /register. URLs are http(s)://host:port.
        `extra` adds fields to the body (a master sends its "register_url")."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if role == "master" and not config_server_url:
            raise ValueError("a master registers with a config server: give config_server_url")
        if not master_url and not config_server_url:
            raise ValueError("give master_url or config_server_url")
        for name, value in (("url", url), ("master_url", master_url), ("config_server_url", config_server_url)):
            if value is not None and not value.startswith(("http://", "https://")):
                raise ValueError(f"{name} must be http(s)://host:port, got {value!r}")
        self.role, self.instance_id, self.url, self.kv_address, self.model = role, instance_id, url, kv_address, model
        self.load_fn = load_fn
        self.master_url = master_url.rstrip("/") if master_url else None
        self.config_server_url = config_server_url.rstrip("/") if config_server_url else None
        self.interval_s = interval_s
        self.extra = dict(extra or {})
        self._ok: dict[str, bool] = {}  # target -> did its last heartbeat succeed (for logging changes)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "Registrar":
        self._thread = threading.Thread(target=self._run, name=f"registrar-{self.instance_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    @property
    def registered_with(self) -> list[str]:
        """The targets whose last heartbeat succeeded."""
        return sorted(t for t, ok in self._ok.items() if ok and t.endswith("/register"))

    def _run(self) -> None:
        timeout = httpx.Timeout(min(self.interval_s * 2, 5.0))
        with httpx.Client(timeout=timeout, trust_env=False) as client:
            while True:
                try:
                    self.beat(client)
                except Exception:  # never out of the thread: the next interval retries
                    log.exception("registrar %s: heartbeat round failed", self.instance_id)
                if self._stop.wait(self.interval_s):
                    return

    def beat(self, client: httpx.Client) -> None:
        """One heartbeat round to every target."""
        try:
            body = self._body()
        except Exception as e:  # the load probe failed: skip this round rather than report a wrong load
            self._note("load", False, f"load_fn failed: {type(e).__name__}: {e}")
            return
        self._note("load", True, "load_fn works again")
        for target in self._targets(client):
            try:
                r = client.post(target, json=body)
                ok, why = r.status_code == 200, f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                ok, why = False, f"{type(e).__name__}: {e}"
            self._note(target, ok, "registered" if ok else why)

    def _body(self) -> dict:
        load = dict(self.load_fn())
        return {"id": self.instance_id, "role": self.role, "url": self.url, "kv_address": self.kv_address,
                "model": self.model, "load": load} | self.extra

    def _targets(self, client: httpx.Client) -> list[str]:
        targets = []
        if self.config_server_url:
            targets.append(self.config_server_url + "/register")
        if self.master_url:
            targets.append(self.master_url + "/pd/register")
        elif self.role != "master":
            targets += [m.rstrip("/") + "/pd/register" for m in self._listed_masters(client)]
        return targets

    def _listed_masters(self, client: httpx.Client) -> list[str]:
        listing = self.config_server_url + "/registry?role=master"
        try:
            r = client.get(listing)
            r.raise_for_status()
            entries = r.json()["entries"]
            masters = [e.get("register_url") or e["url"] for e in entries]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            self._note(listing, False, f"cannot list masters: {type(e).__name__}: {e}")
            return []
        self._note(listing, True, f"masters: {', '.join(masters) or 'none yet'}")
        live = {m.rstrip("/") + "/pd/register" for m in masters}
        for target in [t for t in self._ok if t.endswith("/pd/register") and t not in live]:
            del self._ok[target]  # a master the config server no longer lists: forget its state
        return masters

    def _note(self, target: str, ok: bool, message: str) -> None:
        before = self._ok.get(target)
        if before == ok or (before is None and ok and target == "load"):
            return
        self._ok[target] = ok
        if ok:
            log.info("registrar %s (%s): %s -> %s", self.instance_id, self.role, target, message)
        else:
            log.warning("registrar %s (%s): %s -> %s (retrying every %.1f s)", self.instance_id, self.role,
                        target, message, self.interval_s)
