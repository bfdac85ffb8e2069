"""Speculative decoding, the router's half: proposals and their verdicts (spec.method=ngram or draft).

The router owns each request's token history, so it proposes: the longest suffix of the prompt +
output (spec.ngram_max down to spec.ngram_min tokens) that occurred before is looked up, and the up
to spec.num_tokens tokens that followed its latest earlier occurrence are the proposal (with
spec.method=draft the router plans placeholders and the worker's draft model fills them). A proposing
row is planned as a VerifyChunk (its last token + the proposal, k+1 query tokens over its cached KV:
the chunked-prefill path); the worker samples all k+1 positions, keeps the longest prefix the target
agrees with plus one token of its own (runtime/worker/spec_verify.py), and the router frees the KV
slots of the rejected tail. A proposing row needs its last token, so it is planned only when no step
of it is in flight (it forgoes pipelining; rows that cannot speculate keep it).

Speculation is off for a step whose decode batch exceeds spec.max_batch (verifying k+1 tokens per row
then costs more than it saves), and for rows whose tokens are not drawn from the model's plain
distribution (penalties, exclusions, logprobs, prompt logprobs): they decode one token a step.
KV stays exact: a step speculates only while every live request could reach its peak at once, so
growth faster than one token a step can never make an allocation fail."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from llaunch.runtime.ipc.messages import SamplingParams, StepPlan, StepResult, VerifyChunk
from llaunch.runtime.router.request import Request, Status

if TYPE_CHECKING:
    from llaunch.runtime.config import SpecConfig


def propose(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (ngram_max down to ngram_min tokens long); [] when none occurred."""
    n_tok = len(tokens)
    if k <= 0 or n_tok < ngram_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(ngram_max, n_tok - 1), ngram_min - 1, -1):
        suffix = arr[n_tok - n:]
        # windows starting at 0 .. n_tok-n-1 (the suffix itself excluded)
        windows = np.lib.stride_tricks.sliding_window_view(arr[:n_tok - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return []


def speculates(sp: SamplingParams, produced: int) -> bool:
    """Are this request's next tokens drawn from the model's plain distribution (what verification
    samples)? Token healing's exclusions end with the first token, min_tokens' once that many are out."""
    if sp.penalized or sp.logprobs or sp.prompt_logprobs >= 0:
        return False
    if (sp.constraint or sp.banned_ids or sp.banned_sequences or sp.allowed_ids or sp.bias_ids
            or sp.min_p > 0.0):
        return False
    return produced >= max(sp.min_tokens, 1 if sp.heal_ids else 0)


PROBE_EVERY = 8  # steps a row whose lookup found nothing decodes pipelined before it looks again
# A verify step costs ~1.2 decode steps at batch 1 (docs/performance.md) and gives up pipelining; it
# yields 1 + accepted tokens, so a row whose proposals keep failing loses. A row whose average of
# accepted tokens per verify (halved each verify) falls below this backs off like a failed lookup.
BACKOFF_BELOW = 0.5


@dataclass
class _Verifying:
    req: Request
    proposed: int  # tokens proposed (the chunk holds one more: the row's last token)


class SpecDecoding:
    """Per scheduler: which decode rows verify proposals this step, and the verdicts' bookkeeping.
    `sched` below is the Scheduler that owns it (not imported: it imports this module)."""

    def __init__(self, cfg: Optional["SpecConfig"], vocab_size: int = 2**62):
        self.cfg = cfg
        self.vocab_size = vocab_size  # an image's tokens (ids past it) have no embedding row: never proposed
        method = getattr(cfg.method, "value", cfg.method) if cfg is not None else "none"
        self.enabled = method in ("ngram", "draft")
        self.drafted = method == "draft"  # the worker's draft model fills each proposal (runtime/worker/drafter.py)
        self._out: dict[int, list[_Verifying]] = {}  # step → its verify rows, in plan order
        self.proposed = 0  # since start: tokens proposed to verification
        self.accepted = 0  # of those, tokens the target agreed with
        self.verify_rows = 0  # row-steps that verified a proposal
        # since start: [i] = verifies whose proposal was accepted past its i-th token (vLLM's per-position
        # acceptance: where in a proposal the model stops agreeing)
        self.accepted_per_pos = [0] * (cfg.num_tokens if self.enabled else 0)
        # row → (request id, steps since its last lookup found nothing): such a row keeps pipelining and
        # looks again (waiting for its tokens once) every PROBE_EVERY steps
        self._missed: dict[int, tuple[str, int]] = {}
        self._yield: dict[int, tuple[str, float]] = {}  # row → (request id, recent accepted tokens per verify)
        self.backoffs = 0  # since start: rows that stopped proposing for a while (their proposals kept failing)

    def split(self, sched: Any, decoding: list[Request]) -> tuple[list[Request], dict[int, list[int]]]:
        """(rows that decode one token as usual, {row: proposal} for rows that verify one). A row that
        speculates and has a step in flight sits this step out (its last token is not known yet),
        unless its last lookup found nothing or its proposals kept failing: then it decodes pipelined
        until its next probe."""
        if not self.enabled or len(decoding) > self.cfg.max_batch:
            return decoding, {}
        plain: list[Request] = []
        proposals: dict[int, list[int]] = {}
        lim = sched.limits
        for req in decoding:
            if not speculates(req.sampling, len(req.output_ids)):
                plain.append(req)
                continue
            rid, quiet = self._missed.get(req.row, (None, 0))
            quiet_now = rid == req.id and quiet < PROBE_EVERY  # after a failed lookup or a backoff
            if quiet_now:
                self._missed[req.row] = (rid, quiet + 1)
                plain.append(req)
                continue
            if req.steps_in_flight:
                continue
            room = min(self.cfg.num_tokens, req.max_new_tokens - len(req.output_ids) - 1,
                       lim.max_model_len - req.num_tokens - 1)
            if self.drafted:  # placeholders: the draft proposes on the worker
                proposal = [0] * max(room, 0)
            else:
                proposal = propose(req.prompt_ids + req.output_ids, room, self.cfg.ngram_min, self.cfg.ngram_max)
                proposal = proposal[:next((i for i, t in enumerate(proposal) if t >= self.vocab_size), len(proposal))]
            if proposal:
                proposals[req.row] = proposal
                self._missed.pop(req.row, None)
            else:
                plain.append(req)
                self._missed[req.row] = (req.id, 0)
        if proposals and not self._peaks_fit(sched, sum(len(p) for p in proposals.values())):
            plain += [sched.running[row] for row in proposals]  # under KV pressure: no speculation
            proposals = {}
        return plain, proposals

    def _peaks_fit(self, sched: Any, extra: int) -> bool:
        """Could every live request hold its peak KV at once (after `extra` proposal slots)? Then no
        order of growth can exhaust the cache."""
        margin = sched.limits.pipeline_depth - 1
        live = [r for r in sched.running.values() if r.status in (Status.RUNNING, Status.TRANSFER)]
        peaks = sum(r.peak_tokens - r.num_cached + margin for r in live)
        lingering = sum(len(r.slots) - r.num_cached for r in sched.running.values() if r.status is Status.FINISHED)
        waiting_kv = sum(len(r.slots) - r.num_cached for r in sched._holding(None))
        return peaks + lingering + waiting_kv + sched.cache.locked + extra <= sched.limits.kv_slots

    def plan(self, sched: Any, plan: StepPlan, proposals: dict[int, list[int]]) -> list[Request]:
        """Add the verify chunks to `plan`; their requests (to count as touched by the step)."""
        rows: list[_Verifying] = []
        for row, proposal in proposals.items():
            req = sched.running[row]
            n = len(proposal) + 1
            slots = sched.cache.alloc(n)
            plan.verify.append(VerifyChunk(row=row, token_ids=[req.output_ids[-1]] + proposal,
                                           start=req.num_computed, slots=slots))
            req.slots.extend(slots)
            req.num_computed += n
            req.num_planned += n
            rows.append(_Verifying(req, len(proposal)))
        if rows:
            self._out[plan.step] = rows
        return [v.req for v in rows]

    def _track_yield(self, req: Request, accepted: int) -> None:
        """A row whose recent verifies accepted too little decodes pipelined until its next probe."""
        rid, recent = self._yield.get(req.row, (req.id, 1.0))
        recent = 0.5 * (recent if rid == req.id else 1.0) + 0.5 * accepted
        self._yield[req.row] = (req.id, recent)
        if recent < BACKOFF_BELOW:
            self._missed[req.row] = (req.id, 0)
            self.backoffs += 1

    def verified(self, sched: Any, result: StepResult) -> list:
        """The verdicts of a step's verify rows: free the rejected tail's KV, then append the tokens
        one at a time (a stop condition mid-proposal drops the rest). Returns the TokenDeltas."""
        from llaunch.runtime.ipc.messages import TokenDelta

        rows = self._out.pop(result.step, [])
        if len(rows) != len(result.verified):
            raise RuntimeError(f"step {result.step}: {len(result.verified)} verdicts for {len(rows)} verify rows")
        deltas = []
        for v, tokens in zip(rows, result.verified):
            req = v.req
            accepted = len(tokens) - 1
            self.proposed += v.proposed
            self.accepted += accepted
            for pos in range(accepted):
                self.accepted_per_pos[pos] += 1
            self.verify_rows += 1
            if req.status is not Status.RUNNING:
                continue  # ended while the step was out: its slots go back when it is released
            self._track_yield(req, accepted)
            rejected = v.proposed - accepted
            if rejected:
                sched.kv.free(req.slots[-rejected:])
                del req.slots[-rejected:]
                req.num_computed -= rejected
                req.num_planned -= rejected
            delta = TokenDelta(request_id=req.id, token_ids=[])
            for token in tokens:
                req.output_ids.append(token)
                delta.token_ids.append(token)
                reason = sched._stop_reason(req, token)
                if reason is not None:
                    sched._finish(req, reason)
                    delta.finish_reason = reason
                    break
            deltas.append(delta)
        return deltas
