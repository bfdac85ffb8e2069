"""Speculative decoding, the router's half: proposals and their verdicts (spec.method=ngram or draft).

The router owns each request's token history, so it proposes: the longest suffix of the prompt +
output (spec.ngram_max down to spec.ngram_min tokens) that occurred before is looked up, and the up
to spec.num_tokens tokens that followed its latest earlier occurrence are the proposal (repeating with the period
that occurrence implies where they reach the present: runtime/router/ngram.py) (with
spec.method=draft the router plans placeholders and the worker's draft model fills them). A proposing
row is planned as a VerifyChunk (its last token + the proposal, k+1 query tokens over its cached KV:
the chunked-prefill path); the worker samples all k+1 positions, keeps the longest prefix the target
agrees with plus one token of its own (runtime/worker/spec_verify.py), and the router frees the KV
slots of the rejected tail. A proposing row needs its last token, so it is planned only when no step
of it is in flight (rows that cannot speculate keep pipelining), with one exception:

Chained verifies (greedy n-gram rows). While a row's verify is in flight, the router may plan the row's next
verify as if it kept the whole proposal and its own token after it is the one the n-gram lookup predicts: the
chunk starts with that guess at the position after the in-flight chunk, followed by the proposal that
continues it. On copy-heavy text the guess holds and the row pipelines its verifies like decode steps. When
the in-flight verdict differs (a token rejected, another bonus token, a stop), the chained chunk is void: its
slots leave the request (freed when its verdict comes back, which is dropped), its positions are planned
again at once, and the row's next chunk carries its tokens and position explicitly (the worker's length and last
token of the row come from the void chunk, which runs first). The greedy verdicts do not depend on what the chained chunk
computed, so the output is the unchained one token for token.

With spec.adaptive an n-gram row proposes 1 + its recent accepted tokens per verify (an average halved each verify,
from spec.num_tokens at its start; rounded), at most spec.num_tokens: fewer tokens verified where they keep failing, and a chained
verify's assumption (the whole proposal kept) holds more often.

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
from llaunch.runtime.router.ngram import TokenHistory, propose
from llaunch.runtime.router.request import Request, Status

if TYPE_CHECKING:
    from llaunch.runtime.config import SpecConfig


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
    proposal: list[int]  # the chunk holds one more token first: the row's last, or a chained guess
    slots: list[int]
    assumed: Optional[list[int]] = None  # the verdict a chained successor assumed (the proposal + the guess)
    chained: Optional["_Verifying"] = None  # that successor, planned while this was in flight
    base: Optional["_Verifying"] = None  # the verify this one chained onto, until its verdict held
    void: bool = False  # its assumption failed: the verdict is dropped, the slots freed


@dataclass
class _Chain:
    base: _Verifying  # the row's verify in flight
    guess: int  # its predicted own token: the chained chunk's first


class SpecDecoding:
    """Per scheduler: which decode rows verify proposals this step, and the verdicts' bookkeeping.
    `sched` below is the Scheduler that owns it (not imported: it imports this module)."""

    def __init__(self, cfg: Optional["SpecConfig"], vocab_size: int = 2**62, max_model_len: int = 2**62):
        self.cfg = cfg
        self.max_model_len = max_model_len
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
        # spec.adaptive: row → (request id, recent accepted tokens per verify, from num_tokens at its start)
        self._depth: dict[int, tuple[str, float]] = {}
        self._histories: dict[int, tuple[str, TokenHistory]] = {}  # row → (request id, its tokens as an array)
        self.backoffs = 0  # since start: rows that stopped proposing for a while (their proposals kept failing)
        self._flying: dict[int, _Verifying] = {}  # row → its latest verify in flight
        self._chains: dict[int, _Chain] = {}  # split → plan: rows whose verify chains onto the one in flight
        self._explicit: dict[int, str] = {}  # row → request id: its next chunk must carry its tokens (after a void)
        self.void_slots = 0  # slots of void chunks still in flight (held beyond any request's peak)
        self.chained = 0  # since start: chained verifies planned
        self.voided = 0  # of those, the ones whose assumption failed

    def split(self, sched: Any, decoding: list[Request]) -> tuple[list[Request], dict[int, list[int]]]:
        """(rows that decode one token as usual, {row: proposal} for rows that verify one). A row that
        speculates and has a step in flight sits this step out (its last token is not known yet),
        unless its last lookup found nothing or its proposals kept failing: then it decodes pipelined
        until its next probe. Above spec.max_batch decode rows nothing proposes; a row whose verify is still out
        sits out then too (a decode of it would start where the verdict is not yet known)."""
        if not self.enabled:
            return decoding, {}
        off = len(decoding) > self.cfg.max_batch
        plain: list[Request] = []
        proposals: dict[int, list[int]] = {}
        for req in decoding:
            flying = self._flying.get(req.row)
            # a verify of it is out: chain onto it, or sit out. A void one is no reason to wait: the explicit chunk
            # below queues behind it on the worker (its tokens, positions and slots its own; the void verdict, applied
            # first, sets nothing the explicit one does not set again)
            if flying is not None and flying.req is req and not flying.void:
                chain = None if off else self._chain(req, flying)
                if chain is not None:
                    proposals[req.row] = chain[1]
                    self._chains[req.row] = chain[0]
                continue
            if self._explicit.get(req.row) == req.id:  # after a void chunk: a chunk with its tokens and position
                proposals[req.row] = [] if off or not speculates(req.sampling, len(req.output_ids)) else \
                    self._proposal(req)
                continue
            if off:
                plain.append(req)
                continue
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
            proposal = self._proposal(req)
            if proposal:
                proposals[req.row] = proposal
                self._missed.pop(req.row, None)
            else:
                plain.append(req)
                self._missed[req.row] = (req.id, 0)
        if proposals and not self._peaks_fit(sched, sum(len(p) for p in proposals.values())):
            # under KV pressure: no speculation; a chained row sits out, a row after a void chunk gets an
            # explicit chunk of its last token alone
            for row in list(proposals):
                req = sched.running[row]
                self._chains.pop(row, None)
                if self._explicit.get(row) == req.id:
                    proposals[row] = []
                else:
                    del proposals[row]
                    if not (self._flying.get(row) is not None and self._flying[row].req is req):
                        plain.append(req)
        return plain, proposals

    def _room(self, req: Request, ahead: int = 0) -> int:
        """Tokens a proposal of this row may hold within its length limits, `ahead` tokens (a verify in flight,
        assumed kept whole) after its output: spec.num_tokens, or with spec.adaptive one more than the row
        recently accepted."""
        return min(self._k(req), req.max_new_tokens - len(req.output_ids) - ahead - 1,
                   self.max_model_len - req.num_tokens - ahead - 1)

    def _k(self, req: Request) -> int:
        k = self.cfg.num_tokens
        if not getattr(self.cfg, "adaptive", False) or self.drafted:
            return k
        rid, recent = self._depth.get(req.row, (None, float(k)))
        return k if rid != req.id else max(1, min(k, int(recent + 0.5) + 1))  # rounded half up

    def _track_depth(self, req: Request, accepted: int) -> None:
        rid, recent = self._depth.get(req.row, (req.id, float(self.cfg.num_tokens)))
        if rid != req.id:
            recent = float(self.cfg.num_tokens)
        self._depth[req.row] = (req.id, 0.5 * recent + 0.5 * accepted)

    def _lookup(self, req: Request, k: int, ahead: list[int] = ()) -> list[int]:
        """The proposal after the row's tokens and then `ahead` (a chained verify's assumed tokens)."""
        rid, history = self._histories.get(req.row, (None, None))
        if rid != req.id:
            history = TokenHistory()
            self._histories[req.row] = (req.id, history)
        tokens = history.sync(req.lookup_ids, req.output_ids)
        if ahead:
            tokens = np.concatenate([tokens, np.asarray(ahead, dtype=np.int64)])
        proposal = propose(tokens, k, self.cfg.ngram_min, self.cfg.ngram_max)
        return proposal[:next((i for i, t in enumerate(proposal) if t >= self.vocab_size), len(proposal))]

    def _proposal(self, req: Request) -> list[int]:
        room = self._room(req)
        if self.drafted:  # placeholders: the draft proposes on the worker
            return [0] * max(room, 0)
        return self._lookup(req, room) if room > 0 else []

    def _chain(self, req: Request, flying: _Verifying) -> Optional[tuple[_Chain, list[int]]]:
        """The chained verify onto `flying` (in flight, its verdict unknown): (the chain, its proposal) where the
        row is a greedy n-gram row, `flying` holds no assumption yet and the lookup predicts both the token after
        its proposal and more tokens after that; else None (the row sits the step out)."""
        if (self.drafted or not self.cfg.chain or not req.sampling.greedy or flying.void or flying.chained is not None
                or flying.base is not None or not flying.proposal):  # one assumption at a time
            return None
        # output_ids ends with flying's first token; its proposal follows
        guess = self._lookup(req, 1, flying.proposal)
        room = self._room(req, len(flying.proposal) + 1)
        if not guess or room < 1:
            return None
        proposal = self._lookup(req, room, flying.proposal + guess)
        if not proposal:
            return None
        return _Chain(flying, guess[0]), proposal

    def _peaks_fit(self, sched: Any, extra: int) -> bool:
        """Could every live request hold its peak KV at once (after `extra` proposal slots)? Then no
        order of growth can exhaust the cache."""
        margin = sched.limits.pipeline_depth - 1
        live = [r for r in sched.running.values() if r.status in (Status.RUNNING, Status.TRANSFER)]
        peaks = sum(r.peak_tokens - r.num_cached + margin for r in live)
        lingering = sum(len(r.slots) - r.num_cached for r in sched.running.values() if r.status is Status.FINISHED)
        waiting_kv = sum(len(r.slots) - r.num_cached for r in sched._holding(None))
        return (peaks + lingering + waiting_kv + self.void_slots + sched.cache.locked + extra
                <= sched.limits.kv_slots)

    def plan(self, sched: Any, plan: StepPlan, proposals: dict[int, list[int]]) -> list[Request]:
        """Add the verify chunks to `plan`; their requests (to count as touched by the step)."""
        rows: list[_Verifying] = []
        for row, proposal in proposals.items():
            req = sched.running[row]
            chain = self._chains.pop(row, None)
            n = len(proposal) + 1
            slots = sched.cache.alloc(n)
            first = chain.guess if chain is not None else req.output_ids[-1]
            plan.verify.append(VerifyChunk(row=row, token_ids=[first] + proposal, start=req.num_computed, slots=slots))
            req.slots.extend(slots)
            req.num_computed += n
            req.num_planned += n
            entry = _Verifying(req, list(proposal), slots)
            if chain is not None:
                chain.base.assumed = chain.base.proposal + [chain.guess]
                chain.base.chained, entry.base = entry, chain.base
                self.chained += 1
            self._flying[row] = entry
            self._explicit.pop(row, None)
            rows.append(entry)
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

    def _void(self, req: Request, chained: _Verifying) -> None:
        """`chained` assumed a verdict that did not come: its slots (the request's last ones: nothing of the row
        was planned after it) leave the request, its positions are planned again, and the row's next chunk
        carries its tokens and position."""
        n = len(chained.slots)
        assert req.slots[-n:] == chained.slots, "a void chunk's slots are the request's last"
        del req.slots[-n:]
        req.num_computed -= n
        req.num_planned -= n
        chained.void = True
        self.void_slots += n
        self.voided += 1
        self._explicit[req.row] = req.id

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
            if self._flying.get(req.row) is v:
                del self._flying[req.row]
            if v.void:  # computed on a failed assumption: its slots were taken off the request when it failed
                sched.kv.free(v.slots)
                self.void_slots -= len(v.slots)
                continue
            accepted = len(tokens) - 1
            self.proposed += len(v.proposal)
            self.accepted += accepted
            for pos in range(accepted):
                self.accepted_per_pos[pos] += 1
            self.verify_rows += 1
            if req.status is not Status.RUNNING:
                continue  # ended while the step was out: its slots go back when it is released
            if v.chained is not None:
                if tokens != v.assumed:
                    self._void(req, v.chained)
                else:
                    v.chained.base = None  # it stands: the row may chain onto it
            self._track_yield(req, accepted)
            self._track_depth(req, accepted)
            rejected = len(v.proposal) - accepted
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
