"""/metrics' body in the format the scraper's Accept header asks for: Prometheus text 0.0.4 by default,
OpenMetrics 1.0 when it names application/openmetrics-text (Prometheus asks for it first). The engine's
series arrive as Prometheus text (the detokenizer renders them; the frontends get them in each
MetricsSnapshot); OpenMetrics parses them back into families and renders those.

Both /metrics listeners use it: the frontends' (runtime/http/app.py, with their own process_* series)
and server.metrics_port's (`serve`, in the detokenizer)."""
from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.parser import text_string_to_metric_families

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_CONTENT_TYPE = openmetrics.CONTENT_TYPE_LATEST
# prometheus_client >= 0.23 renders OpenMetrics with `underscores` escaping by default, which turns a
# sample's `llaunch:` into `llaunch_` but not its HELP/TYPE lines' (client_python#1177). Every name here
# is a legacy Prometheus name, which allow-utf-8 writes unchanged.
_KEEP_NAMES = {"escaping": openmetrics.ALLOWUTF8} if hasattr(openmetrics, "ALLOWUTF8") else {}


def wants_openmetrics(accept: str) -> bool:
    return any(part.split(";")[0].strip() == "application/openmetrics-text" for part in (accept or "").split(","))


class _Families:
    """A collector of the engine's families, parsed back from their text, and a registry's."""

    def __init__(self, engine_text: str, process: Optional[CollectorRegistry]):
        self.engine_text = engine_text
        self.process = process

    def collect(self) -> Iterator[Metric]:
        yield from text_string_to_metric_families(self.engine_text)
        if self.process is not None:
            yield from self.process.collect()


def exposition(engine_text: str, process: Optional[CollectorRegistry], accept: str) -> tuple[bytes, str]:
    """(body, content type) of `engine_text` and the `process` registry's series for a scrape sending
    `accept`."""
    if wants_openmetrics(accept):
        return openmetrics.generate_latest(_Families(engine_text, process), **_KEEP_NAMES), OPENMETRICS_CONTENT_TYPE
    extra = generate_latest(process) if process is not None else b""
    return engine_text.encode() + extra, PROMETHEUS_CONTENT_TYPE  # the text as rendered: nothing parsed


def serve(host: str, port: int, render: Callable[[], str]) -> ThreadingHTTPServer:
    """Answer GET on any path with `render()`'s series from daemon threads (server.metrics_port: no API
    key). A port that cannot be bound raises here."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body, content_type = exposition(render(), None, self.headers.get("Accept", ""))
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # a scrape every few seconds is not news
            pass

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        daemon_threads = True

    server = Server((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
