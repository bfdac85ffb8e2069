"""Rules over the HTTP side's optional listeners and API shapes: the metric server's own port
(server.metrics_port, LightLLM's metric_port), the TGI API (server.tgi_api, LightLLM's use_tgi_api) and the chat
template file (server.chat_template)."""
from __future__ import annotations

import socket
from typing import Optional

from llaunch.launcher.rule_registry import rule
from llaunch.launcher.rules_model import serves
from llaunch.runtime.config import Mode


def bind_error(host: str, port: int) -> Optional[str]:
    """Why `port` on `host` cannot be bound now (None: it can); TIME_WAIT leftovers do not count."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


@rule()
def metrics_port_valid(cfg):
    s = cfg.server
    if s.metrics_port is None:
        return
    if not 1 <= s.metrics_port <= 65535:
        yield ("server.metrics_port",), f"server.metrics_port={s.metrics_port} must be in 1..65535 (null: off)"
    if not serves(cfg):  # pd_master and config_server have no metrics hub: the detokenizer owns it
        yield ("server.metrics_port", "mode.kind"), (
            f"server.metrics_port with mode.kind={cfg.mode.kind.value}: only serving instances (normal, pd_prefill, "
            "pd_decode) have metrics; set server.metrics_port=null")
    # metrics_port == server.port (or any other port of this instance): rules.ports_distinct


@rule(live="skip")
def metrics_port_free(cfg):
    s = cfg.server
    if s.metrics_port is None or not 1 <= s.metrics_port <= 65535 or cfg.parallel.node_rank > 0 or not serves(cfg):
        return  # the detokenizer, which binds it, runs on node 0
    why = bind_error(s.metrics_host, s.metrics_port)
    if why:
        yield ("server.metrics_port", "server.metrics_host"), (
            f"server.metrics_port={s.metrics_port} on server.metrics_host={s.metrics_host} cannot be bound ({why}); "
            "another process holds it: pick another server.metrics_port")


@rule()
def tgi_api_mode(cfg):
    if cfg.server.tgi_api and cfg.mode.kind != Mode.normal:
        yield ("server.tgi_api", "mode.kind"), (
            f"server.tgi_api=true with mode.kind={cfg.mode.kind.value}: the TGI API is served by normal instances "
            "only (the pd_master relays LightLLM's and OpenAI's shapes); set server.tgi_api=false or mode=normal")


@rule()
def chat_template_readable(cfg):
    """The frontend renders every chat prompt with it: a template that cannot be read would fail each chat."""
    path = cfg.server.chat_template
    if path is None or not serves(cfg):
        return
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        yield ("server.chat_template",), (f"server.chat_template={path}: cannot be read ({e.__class__.__name__}: "
                                          f"{e}); give a Jinja template file (vLLM's --chat-template), or unset it")
        return
    if "{{" not in text and "{%" not in text:
        yield ("server.chat_template",), (f"server.chat_template={path} holds no Jinja ({{{{ or {{%}}): give the "
                                          "template file itself, or unset it for the tokenizer's template")
