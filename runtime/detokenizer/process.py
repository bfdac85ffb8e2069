"""The detokenizer process: PULL router messages, PUSH text and metrics snapshots to the frontends.

    python -m llaunch.runtime.detokenizer.process --config RUN_DIR/config.yaml --name detokenizer

Loop: recv → Detokenizer.handle (dispatch by type) → send; a metrics snapshot goes to every frontend
at least every HEARTBEAT_S, and soon after a request finishes. SIGINT and SIGTERM exit (within one
heartbeat): the launcher drains the frontends first and signals this process only at teardown.
"""
from __future__ import annotations

import logging
import re
import time

import zmq

from llaunch.runtime.config import ProcessSpec
from llaunch.runtime.bootstrap import StopFlag, report_ready, start
from llaunch.runtime.models.tokenizer import load_tokenizer
from llaunch.runtime.detokenizer.detokenizer import HEARTBEAT_S, Detokenizer
from llaunch.runtime.ipc.messages import DetokenizerInbound
from llaunch.runtime.ipc.sockets import Receiver, Sender

log = logging.getLogger("llaunch.detokenizer")


def frontend_endpoints(spec: ProcessSpec) -> dict[int, str]:
    """`text.{i}` connect endpoints by frontend index."""
    found = {int(m.group(1)): addr for key, addr in spec.connects.items()
             if (m := re.fullmatch(r"text\.(\d+)", key))}
    if not found:
        raise SystemExit(f"{spec.name}: no text.<i> endpoints in connects {sorted(spec.connects)}")
    return found


def serve(detok: Detokenizer, receiver: Receiver, frontends: dict[int, Sender], stop: StopFlag) -> None:
    while not stop.requested:
        wait_s = min(max(detok.next_snapshot_at() - time.time(), 0.0), HEARTBEAT_S)  # -inf before the first
        msg = receiver.recv(timeout_ms=int(wait_s * 1000) + 1)
        now = time.time()
        if msg is not None:
            for frontend, batch in detok.handle(msg, now).items():
                frontends[frontend].send(batch)
        if detok.snapshot_due(now):
            snapshot = detok.snapshot(now)
            for sender in frontends.values():
                sender.send(snapshot)


def main() -> None:
    cfg, spec = start()
    tokenizer = load_tokenizer(cfg.model)
    ctx = zmq.Context()
    receiver: Receiver = Receiver(ctx, spec.binds["tokens"], DetokenizerInbound)
    frontends = {i: Sender(ctx, addr) for i, addr in frontend_endpoints(spec).items()}
    detok = Detokenizer(tokenizer, model_name=cfg.model.name, dp=cfg.parallel.dp,
                        max_model_len=cfg.model.max_model_len or 32768,
                        metrics_prefix=f"{cfg.server.metrics_prefix.value}:")
    stop = StopFlag().install()
    if "metrics" in spec.binds:  # server.metrics_port
        detok.metrics.serve(spec.binds["metrics"])
    report_ready(ctx, cfg, spec, frontends=str(len(frontends)))
    log.info("ready: %s -> %d frontend(s)", spec.binds["tokens"], len(frontends))
    try:
        serve(detok, receiver, frontends, stop)
    except KeyboardInterrupt:
        pass
    finally:
        receiver.close()
        for sender in frontends.values():
            sender.close()
        ctx.term()


if __name__ == "__main__":
    main()
