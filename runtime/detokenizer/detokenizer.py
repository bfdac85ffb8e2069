"""The detokenizer's logic, without sockets: router messages in, frontend messages out.

`handle(msg, now)` dispatches by message type (a table) and returns one TextBatch per frontend that
has news; `snapshot_due(now)` / `snapshot(now)` give the metrics snapshots (the frontends'
heartbeat). process.py drives it over ZMQ; tests drive it directly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from llaunch.runtime.detokenizer.incremental import IncrementalDecoder
from llaunch.runtime.detokenizer.metrics import MetricsHub
from llaunch.runtime.ipc.messages import (DetokenizerInbound, MetricsSnapshot, RequestOpened, RouterStats,
                                          TextBatch, TextDelta, TokenBatch, TokenDelta)

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5  # frontends call the graph unhealthy when snapshots stop
MIN_SNAPSHOT_GAP_S = 0.05  # finished requests trigger a snapshot, at most ~20 a second


@dataclass
class OpenRequest:
    opened: RequestOpened
    decoder: IncrementalDecoder
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    scheduled_time: float = 0.0  # when the router gave it a row
    first_output_time: Optional[float] = None
    last_output_time: Optional[float] = None


class Detokenizer:
    def __init__(self, tokenizer: Any, model_name: str, dp: int = 1, max_model_len: int = 32768,
                 metrics_prefix: str = "llaunch:"):
        self.tokenizer = tokenizer
        self.metrics = MetricsHub(model_name, dp=dp, max_model_len=max_model_len, prefix=metrics_prefix)
        self.requests: dict[str, OpenRequest] = {}
        self.last_snapshot = float("-inf")
        self.finished_since_snapshot = False
        self._spaced: dict[str, dict[int, str]] = {}
        self._handlers: dict[type, Callable[[Any, float], dict[int, TextBatch]]] = {
            RequestOpened: self._open,
            TokenBatch: self._tokens,
            RouterStats: self._stats,
        }

    def handle(self, msg: DetokenizerInbound, now: float) -> dict[int, TextBatch]:
        """Apply one router message; returns {frontend index: TextBatch} to send."""
        return self._handlers[type(msg)](msg, now)

    # ---- handlers -------------------------------------------------------------------------------

    def _open(self, msg: RequestOpened, now: float) -> dict[int, TextBatch]:
        if msg.request_id in self.requests:
            log.warning("request %s opened twice; starting it over", msg.request_id)
        sp = msg.sampling
        decoder = IncrementalDecoder(self.tokenizer, sp.skip_special_tokens, sp.stop, sp.heal_text,
                                     sp.include_stop_str_in_output, sp.min_tokens,
                                     self._spaced_tokens(sp.skip_special_tokens) if sp.spaces_between_special_tokens
                                     else None)
        self.requests[msg.request_id] = OpenRequest(msg, decoder)
        return {}

    def _spaced_tokens(self, skip_special: bool) -> dict[int, str]:
        """spaces_between_special_tokens: the added tokens that stay in the text, by id → their text."""
        key = "skip" if skip_special else "keep"
        if key not in self._spaced:
            special = set(getattr(self.tokenizer, "all_special_ids", ()))
            added = getattr(self.tokenizer, "added_tokens_decoder", {})
            self._spaced[key] = {i: t.content for i, t in added.items() if not (skip_special and i in special)}
        return self._spaced[key]

    def _tokens(self, msg: TokenBatch, now: float) -> dict[int, TextBatch]:
        out: dict[int, list[TextDelta]] = {}
        for delta in msg.deltas:
            req = self.requests.get(delta.request_id)
            if req is None:  # ended here by a stop string; the frontend aborts it at the router
                log.debug("tokens for closed request %s dropped", delta.request_id)
                continue
            text_delta = self._advance(req, delta, now)
            if text_delta is not None:
                out.setdefault(req.opened.frontend, []).append(text_delta)
        return {frontend: TextBatch(deltas=deltas) for frontend, deltas in out.items()}

    def _stats(self, msg: RouterStats, now: float) -> dict[int, TextBatch]:
        self.metrics.record_stats(msg)
        return {}

    # ---- one request's step ---------------------------------------------------------------------

    def _advance(self, req: OpenRequest, delta: TokenDelta, now: float) -> Optional[TextDelta]:
        req.cached_tokens = max(req.cached_tokens, delta.cached_tokens)
        req.scheduled_time = delta.scheduled_time or req.scheduled_time
        pieces: list[str] = []
        used = 0
        # the eos / stop token that ends the output: its text only where asked (vLLM's include_stop_str_in_output)
        silent = len(delta.token_ids) - 1 if delta.finish_reason == "stop" and not req.opened.sampling.stop_token_text else -1
        for k, token_id in enumerate(delta.token_ids):
            used += 1
            if k == silent:
                break
            pieces.append(req.decoder.push(token_id))
            if req.decoder.stopped:
                break  # tokens after the stop string are not part of the output
        finish = "stop" if req.decoder.stopped else delta.finish_reason
        if finish is not None and not req.decoder.stopped:
            pieces.append(req.decoder.flush())
        if used == 0 and finish is None:
            return None
        self._record_output(req, used, now)
        if finish is not None:
            del self.requests[delta.request_id]
            self.metrics.finished(req.opened.arrival_time, now, finish, req.opened.prompt_len, req.completion_tokens,
                                  req.first_output_time or 0.0, req.scheduled_time)
            self.finished_since_snapshot = True
            _log_finished(req, delta, finish, now)
        return TextDelta(
            request_id=delta.request_id, text="".join(pieces), token_ids=delta.token_ids[:used],
            logprobs=delta.logprobs[:used], top_ids=delta.top_ids[:used],
            top_logprobs=delta.top_logprobs[:used], finish_reason=finish,
            prompt_tokens=req.opened.prompt_len, completion_tokens=req.completion_tokens,
            stopped_by_string=req.decoder.stopped, kv_transfer_ms=delta.kv_transfer_ms, error=delta.error,
            cached_tokens=delta.cached_tokens, prompt_logprobs=delta.prompt_logprobs, scores=delta.scores)

    def _record_output(self, req: OpenRequest, tokens: int, now: float) -> None:
        if tokens == 0:
            return
        if req.last_output_time is None:
            req.first_output_time = now
            self.metrics.first_token(req.opened.arrival_time, now, req.opened.prompt_len, req.scheduled_time)
        else:
            self.metrics.token_gap(now - req.last_output_time)
        req.last_output_time = now
        req.completion_tokens += tokens
        self.metrics.generated(tokens)

    # ---- metrics snapshots ----------------------------------------------------------------------

    def next_snapshot_at(self) -> float:
        gap = MIN_SNAPSHOT_GAP_S if self.finished_since_snapshot else HEARTBEAT_S
        return self.last_snapshot + gap

    def snapshot_due(self, now: float) -> bool:
        return now >= self.next_snapshot_at()

    def snapshot(self, now: float) -> MetricsSnapshot:
        self.last_snapshot = now
        self.finished_since_snapshot = False
        return MetricsSnapshot(time=now, text=self.metrics.render(), running=self.metrics.num_running,
                               waiting=self.metrics.num_waiting, stalled_replicas=self.metrics.stalled_replicas,
                               loading_replicas=self.metrics.loading_replicas)


def _log_finished(req: OpenRequest, delta: TokenDelta, finish: str, now: float) -> None:
    """One INFO line per finished request: what it cost and how it went."""
    if not log.isEnabledFor(logging.INFO):
        return
    arrival = req.opened.arrival_time
    ttft = f"{(req.first_output_time - arrival) * 1e3:.0f} ms" if req.first_output_time is not None else "-"
    log.info("request %s %s: %d prompt (%d cached) + %d output tokens, TTFT %s, latency %.0f ms%s",
             delta.request_id, finish, req.opened.prompt_len, req.cached_tokens, req.completion_tokens, ttft,
             (now - arrival) * 1e3, f" ({delta.error})" if delta.error else "")
