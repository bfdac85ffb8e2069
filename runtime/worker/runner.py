"""Turns a StepPlan into a ForwardBatch, runs the model and samples. The worker keeps each row's
last sampled token and length, so a decode step needs nothing from the router but slot ids.

`launch` enqueues a step's device work and returns at once; `finish` waits for its tokens. The
worker launches step N+1 before finishing step N, so the host prepares the next step while the
device computes (the router plans ahead for that)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import settings as kernel_settings
from llaunch.runtime.ipc.messages import StepPlan, StepResult
from llaunch.runtime.models.batch import ForwardBatch, KvCache
from llaunch.runtime.models.pooling import PooledRows
from llaunch.runtime.worker.mixed_graphs import MixedGraphs
from llaunch.runtime.worker.prefill_graphs import PrefillGraphs, alone_chunk
from llaunch.runtime.worker.prompt_logprobs import PromptLogprobRows, PromptPart
from llaunch.runtime.worker.sampling_state import SamplingState, logprobs_to_host
from llaunch.runtime.worker.spec_verify import PendingVerify, Verifier
from llaunch.runtime.worker.transfer import to_device, to_host_async
from llaunch.runtime.worker.verify_graphs import VerifySteps, verify_tokens


@dataclass
class PendingStep:
    step: int
    rows: list[int]
    tokens: Optional[torch.Tensor]  # on the host (pinned) once `done` fires
    done: Optional[torch.cuda.Event]
    logprobs: object
    t0: float
    started: float = 0.0  # the trace's timings (timed runners only): monotonic start, host enqueue time
    launch_s: float = 0.0
    start_event: Optional[torch.cuda.Event] = None  # recorded before the step's first device work
    deferred: Optional[torch.Tensor] = None  # logits whose sampling waits for earlier tokens (sample_deferred)
    scores: Optional[torch.Tensor] = None  # a score model's head outputs [rows, num_labels], instead of tokens
    prompt: Optional[PromptPart] = None  # prompt logprobs of the step's chunks that asked
    prompt_takers: Optional[list[tuple[int, int, str]]] = None  # (index, row, request) of sampled rows that asked
    verify: Optional[PendingVerify] = None  # speculative decoding: the verify chunks' verdicts


class ModelRunner:
    def __init__(self, model, kv: KvCache, max_rows: int, device: torch.device, cuda_graphs: bool = False,
                 prefill_graph_tokens: int = 0, timed: bool = False, eos_ids: tuple[int, ...] = (),
                 grammar: Optional[Callable] = None, graph_max_len: Optional[int] = None, images=None,
                 verify_tokens: int = 0, drafter=None, pooling=None, mixed_graph_tokens: int = 0):
        """`kv` has one row and one slot more than the router uses: scratch space for padding.
        `prefill_graph_tokens`: with CUDA graphs, the longest chunk a lone prefill replays one for.
        `timed` (a step trace is on): on a GPU each step also reports its host and device time.
        `eos_ids`, `grammar`: what SamplingState needs for min_tokens and structured output.
        `graph_max_len`: the longest context a decode graph covers (None: every one the KV rows hold).
        `verify_tokens`: the most tokens a speculating step has (verify steps up to it are padded to
        CUDA-graph buckets: runtime/worker/verify_graphs.py).
        `drafter`: spec.method=draft's Drafter (runtime/worker/drafter.py), else None.
        `pooling`: an embedding model's model.pooling (last when None).
        `mixed_graph_tokens`: with CUDA graphs, the longest step with prefill chunks (or decode rows the decode
        graphs do not take) that replays piecewise graphs (runtime/worker/mixed_graphs.py); 0: eager."""
        self.model = model
        self.kv = kv
        self.images = images  # ImageRows (runtime/worker/image_rows.py) of a multimodal model, else None
        self.drafter = drafter
        self.device = device
        self.max_rows = max_rows
        self.sampling = SamplingState(max_rows, model.arch.vocab_size, device, eos_ids, grammar)
        self.last_token = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)
        self.seq_len = [0] * max_rows  # tokens in the KV cache per row (host mirror)
        self.verifier = Verifier(self.sampling, self.last_token, device)
        self.prompt_logprobs = PromptLogprobRows(max_rows)
        self._prompt_rows: list[tuple[int, int, int]] = []  # this step's (row, start, positions) that asked
        self.graphs = None
        self._graph_len_bound = False  # model.graph_max_len_in_batch below the KV rows' length
        self.prefill_graphs = None  # PrefillGraphs: a prompt's last chunk when it runs alone
        self.mixed_graphs = None  # MixedGraphs: the other steps, piecewise
        # under a step trace, each step also reports its host and device time (two timed CUDA events)
        self.timed = timed and device.type == "cuda"
        # a score model (model.task=score) only prefills: its rows' head outputs are the result, no sampling;
        # so does an embedding model (model.task=embed), whose rows' pooled hidden states are
        self.scores_only = bool(model.arch.num_labels) or model.arch.embed
        self.pooled = PooledRows(pooling or "last", max_rows, model.arch.hidden_size, device) if model.arch.embed else None
        self._pool_parts: list[tuple[int, int]] = []  # this step's (row, positions) that mean / CLS pooling reads
        if cuda_graphs and device.type == "cuda" and not self.scores_only:
            from llaunch.runtime.worker.cuda_graphs import DecodeGraphs

            scratch_slot = kv.num_slots - 1
            kv.req_to_slots[max_rows].fill_(scratch_slot)
            graph_len = min(graph_max_len or kv.req_to_slots.shape[1], kv.req_to_slots.shape[1])
            self._graph_len_bound = graph_len < kv.req_to_slots.shape[1]  # else every context fits
            self.graphs = DecodeGraphs(model, kv, self.last_token, max_rows, graph_len,
                                       scratch_row=max_rows, scratch_slot=scratch_slot)
            self.graphs.capture()
            if prefill_graph_tokens > 0:
                self.prefill_graphs = PrefillGraphs(model, kv, min(prefill_graph_tokens, kv.req_to_slots.shape[1]),
                                                    scratch_row=max_rows, scratch_slot=scratch_slot)
                self.prefill_graphs.capture()
            if mixed_graph_tokens > 0:
                self.mixed_graphs = MixedGraphs(model, kv, mixed_graph_tokens, scratch_slot)
                self.mixed_graphs.capture()
        # verify steps (no prefill chunk) run as decode steps of several tokens per verifying row
        verify_len = self.graphs.max_model_len if self.graphs else kv.req_to_slots.shape[1]
        # spec.method=draft: the draft's proposing steps, and its mirror of a step without prefill chunks as
        # the verify steps' layout, both padded to buckets (CUDA graphs on a GPU); the verify steps (the model's
        # and the mirror) read proposals the draft leaves on the device
        self.draft_mirror, proposed = None, None
        if drafter is not None:
            drafter.pad_steps(verify_len, scratch_row=max_rows, scratch_slot=kv.num_slots - 1,
                              capture=self.graphs is not None)
            proposed = drafter.proposed()
            self.draft_mirror = VerifySteps(drafter.model, drafter.kv, self.last_token, verify_tokens, verify_len,
                                            scratch_row=max_rows, scratch_slot=kv.num_slots - 1,
                                            embed_rows=drafter.embed_rows, proposed=proposed)
            if self.graphs is not None:
                self.draft_mirror.capture()
        self.verify_steps = None if self.scores_only else VerifySteps(
            model, kv, self.last_token, verify_tokens, verify_len, scratch_row=max_rows, scratch_slot=kv.num_slots - 1,
            verdicts=True, proposed=proposed)
        self._verdict: Optional[torch.Tensor] = None  # the verify step's greedy verdict (VerifySteps.run)
        self._proposed = 0  # this step's proposals are on the device, this many a chunk (Drafter.propose)
        self._verify_rows: list[int] = []  # the rows of the last launched step's verify chunks, in order
        if self.graphs is not None and self.verify_steps is not None:
            self.verify_steps.capture()
        if device.type == "cuda":
            self._warm_eager(max_rows, kv.num_slots - 1)

    @torch.inference_mode()
    def _warm_eager(self, scratch_row: int, scratch_slot: int) -> None:
        """Build (JIT) the kernels of an eager step before serving: the graphs captured PDL variants,
        and a mixed step (decode rows + prefill chunks) launches the plain ones, which would otherwise
        compile for seconds inside the first such step, under load (H200: a 1.2 s step)."""
        self.kv.req_to_slots[scratch_row].fill_(scratch_slot)
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=self.device)  # noqa: E731
        row, n = [scratch_row], 3  # one decode token, then a 2-token chunk continuing a 1-token prefix
        batch = ForwardBatch(input_ids=t([0] * n), positions=t([1, 1, 2]), out_slots=t([scratch_slot] * n),
                             decode_rows=t(row), decode_seq_lens=t([2]), prefill_rows=t(row), prefill_q_starts=t([1]),
                             prefill_q_lens=t([2]), prefill_prefix_lens=t([1]), logits_index=t([0, 2]),
                             num_decode=1, num_prefill_tokens=2, max_prefill_len=2, max_decode_len=2)
        logits = self.model.forward(batch, self.kv)
        if self.drafter is not None:  # the draft's shapes differ from the model's: its kernels compile too
            self.drafter.mirror(batch)
        if self.scores_only:
            torch.cuda.synchronize()
            return
        # and sampling's: penalties, then a draw with and without the top-k / top-p search
        f32 = dict(dtype=torch.float32, device=self.device)
        two = lambda value: torch.full((2,), value, **f32)  # noqa: E731
        penalized = ops.apply_penalties(logits, torch.zeros_like(logits), two(0.5), two(0.5), two(1.1),
                                            torch.zeros(logits.shape, dtype=torch.bool, device=self.device))
        for top_filters in (True, False):
            ops.sample(penalized, two(0.7), two(0.9), t([5, -1]), t([1, 2]), t([0, 0]), top_filters=top_filters)
        torch.cuda.synchronize()

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def _start_rows(self, plan: StepPlan) -> None:
        self.prompt_logprobs.release(plan.release_rows)  # before `new`, which may reuse those rows
        vocab = self.model.arch.vocab_size  # an image's tokens (vocab + hash) take no part in penalties
        self.sampling.set_rows([(new.row, new.sampling, [t for t in new.prompt_ids if t < vocab] if new.images
                                 else new.prompt_ids) for new in plan.new])
        for new in plan.new:
            if self.images is not None:
                self.images.start(new)
            self.prompt_logprobs.start(new)
            cached = len(new.cached_slots)
            if cached:  # the prompt cache's prefix: its first chunk starts at `cached` and reads these
                self.kv.req_to_slots[new.row, :cached] = self._tensor(new.cached_slots).to(self.kv.req_to_slots.dtype)
            self.seq_len[new.row] = cached
            if self.pooled is not None:
                self.pooled.start(new.row, len(new.prompt_ids), cached)

    def build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, list[int]]:
        """The forward inputs, and the rows whose next token is sampled (in logits order)."""
        nd = len(plan.decode_rows)
        positions = [self.seq_len[r] for r in plan.decode_rows]
        table_rows, table_pos, table_slots = list(plan.decode_rows), list(positions), list(plan.decode_slots)
        decode_lens = []
        for r in plan.decode_rows:
            self.seq_len[r] += 1
            decode_lens.append(self.seq_len[r])
        prefill_ids: list[int] = []
        q_starts, q_lens, prefix_lens, p_rows = [], [], [], []
        logits_index = list(range(nd))
        sampled_rows = list(plan.decode_rows)
        offset = nd
        prompt_index: list[int] = []  # after the sampled rows' logits: prompt positions that asked
        self._prompt_rows = []
        pool_index: list[int] = []  # after those: positions an embedding model's pooling reads besides the last
        self._pool_parts = []
        verify_index = []  # every position of a verify chunk is sampled; their logits come last
        for k, chunk in enumerate([*plan.prefill, *plan.verify]):
            n = len(chunk.token_ids)
            prefill_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + n))
            table_rows.extend([chunk.row] * n)
            table_pos.extend(range(chunk.start, chunk.start + n))
            table_slots.extend(chunk.slots)
            p_rows.append(chunk.row)
            q_starts.append(offset)
            q_lens.append(n)
            prefix_lens.append(chunk.start)
            if k >= len(plan.prefill):  # a verify chunk: its row's length follows the verdict
                verify_index.extend(range(offset, offset + n))
                offset += n
                continue
            self.seq_len[chunk.row] = chunk.start + n
            asked = self.prompt_logprobs.targets(chunk)
            if asked:
                prompt_index.extend(range(offset, offset + asked))
                self._prompt_rows.append((chunk.row, chunk.start, asked))
            pooled = self.pooled.positions(chunk.start, n) if self.pooled is not None else 0
            if pooled:
                pool_index.extend(range(offset, offset + pooled))
                self._pool_parts.append((chunk.row, pooled))
            offset += n
            if chunk.sample:
                logits_index.append(offset - 1)
                sampled_rows.append(chunk.row)

        slots_t = self._tensor(table_slots)
        self.kv.req_to_slots[self._tensor(table_rows), self._tensor(table_pos)] = slots_t.to(self.kv.req_to_slots.dtype)
        decode_rows_t = self._tensor(plan.decode_rows)
        input_ids = self.last_token[decode_rows_t]
        if prefill_ids:
            input_ids = torch.cat([input_ids, self._tensor(prefill_ids)])
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=self._tensor(positions),
            out_slots=slots_t,
            decode_rows=decode_rows_t,
            decode_seq_lens=self._tensor(decode_lens),
            prefill_rows=self._tensor(p_rows),
            prefill_q_starts=self._tensor(q_starts),
            prefill_q_lens=self._tensor(q_lens),
            prefill_prefix_lens=self._tensor(prefix_lens),
            logits_index=self._tensor(logits_index + prompt_index + pool_index + verify_index),
            num_decode=nd,
            num_prefill_tokens=len(prefill_ids),
            max_prefill_len=max(q_lens, default=0),
            max_decode_len=max(decode_lens, default=0),
            every_token=not plan.prefill and not plan.verify,  # logits_index is range(nd)
        )
        if self.images is not None:
            batch = self.images.decorate(batch, plan)
        return batch, sampled_rows

    def _forward(self, plan: StepPlan) -> tuple[Optional[torch.Tensor], list[int], Optional[torch.Tensor]]:
        """(logits, sampled rows, greedy tokens already recorded as the rows' last tokens, or None)."""
        if self._verify_layout(plan):
            logits, self._verdict = self.verify_steps.run(verify_tokens(plan, self.seq_len, self._proposed))
            return logits, list(plan.decode_rows), None
        longest = (max((self.seq_len[r] + 1 for r in plan.decode_rows), default=0)  # contexts after this step
                   if self.graphs is not None and self._graph_len_bound else 0)
        if self.graphs is not None and not plan.prefill and not plan.verify and self.graphs.fits(len(plan.decode_rows), longest):
            rows = list(plan.decode_rows)
            positions = [self.seq_len[r] for r in rows]
            for r in rows:
                self.seq_len[r] += 1
            lens = [p + 1 for p in positions]
            if self.images is not None:  # M-RoPE: a decode token's position is shifted by its images
                positions = [p + self.images.delta(r) for p, r in zip(positions, rows)]
            logits, greedy = self.graphs.run(rows, positions, list(plan.decode_slots), lens)
            return logits, rows, greedy
        chunk = (None if self.prefill_graphs is None or plan.verify
                 else alone_chunk(plan, self.prefill_graphs.max_tokens))
        if chunk is not None and kernel_settings.invariant_step(len(chunk.token_ids)):
            chunk = None  # kernels.row_invariant: a small step unpadded (its graph's 64 rows would take cuBLAS)
        if chunk is not None and self.images is not None and self.images.has(chunk.row):
            chunk = None  # its positions are M-RoPE's and it holds image embeddings: the eager path
        if chunk is not None and not self.prompt_logprobs.asks(chunk.row):  # its graph returns one row of logits
            self.seq_len[chunk.row] = chunk.start + len(chunk.token_ids)
            return self.prefill_graphs.run(chunk), [chunk.row], None
        batch, rows = self.build_batch(plan)
        if batch.num_tokens == 0:
            return None, [], None
        if (self.mixed_graphs is not None and self.mixed_graphs.fits(batch)
                and not kernel_settings.invariant_step(batch.num_tokens)):  # as a small alone chunk above
            return self.mixed_graphs.run(batch), rows, None
        return self.model.forward(batch, self.kv), rows, None

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> PendingStep:
        """Enqueue the step's forward and, unless a row's token mask depends on tokens not read back
        yet (`PendingStep.deferred`: call `sample_deferred` once every earlier step is finished), its
        sampling; with spec.draft_ahead, behind them the draft's next proposals for the step's verifying rows
        (after the step's end is recorded: reading its tokens does not wait for them)."""
        pending = self._launch(plan)
        rows, self._verify_rows = self._verify_rows, [c.row for c in plan.verify]
        # only where the rows verified in the launch before too: with more rows than one step keeps in flight, the
        # router alternates steps of other rows, whose proposals would take the buffer first
        if self._proposed and self._verdict is not None and rows == self._verify_rows:
            t0 = time.perf_counter()
            nv = sum(len(c.token_ids) for c in plan.verify)
            self.drafter.propose_ahead(plan.verify, self._verdict[-nv:], self.last_token)
            pending.launch_s += time.perf_counter() - t0
        return pending

    def _launch(self, plan: StepPlan) -> PendingStep:
        t0 = time.perf_counter()
        started, start_event = time.monotonic(), None
        if self.timed:
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        self._start_rows(plan)
        self._proposed = self._draft(plan) if self.drafter is not None else 0
        self._prompt_rows, self._pool_parts, self._verdict = [], [], None
        logits, rows, greedy = self._forward(plan)
        pending = PendingStep(plan.step, rows, None, None, None, t0, started, 0.0, start_event)
        if plan.verify:  # their logits are the last ones
            nv = sum(len(c.token_ids) for c in plan.verify)
            pending.verify = self.verifier.launch(logits[-nv:], plan.verify,
                                                  None if self._verdict is None else self._verdict[-nv:])
            logits = logits[:-nv]
        if self._pool_parts:  # before them: the pooled positions of this step's chunks
            npool = sum(n for _, n in self._pool_parts)
            self.pooled.add(logits[-npool:], self._pool_parts)
            logits = logits[:-npool]
        if self._prompt_rows:  # the logits past the sampled rows' are prompt positions
            pending.prompt = self.prompt_logprobs.compute(logits[len(rows):], self._prompt_rows)
            logits = logits[:len(rows)]
        pending.prompt_takers = self.prompt_logprobs.takers(rows)
        if logits is None or not rows:
            pending.rows = []
            if pending.verify is not None and self.device.type == "cuda":
                # the worker polls `ready` while it takes the next plans: without an event a verify-only step
                # reads as ready at once and `finish` blocks the loop until the device is done (no overlap)
                pending.done = torch.cuda.Event(enable_timing=self.timed)
                pending.done.record()
            pending.launch_s = time.perf_counter() - t0
            return pending
        if self.scores_only:
            self._scored(pending, logits if self.pooled is None else self.pooled.pooled(rows, logits))
        elif greedy is not None and self.sampling.plain_greedy(rows):
            self.sampling.advance(rows)
            self._sampled(pending, logits, greedy)  # the graph's argmax, already each row's last token
        elif self.sampling.needs_history(rows):
            pending.deferred = logits
        else:
            self._sample(pending, logits)
        pending.launch_s = time.perf_counter() - t0
        return pending

    def _verify_layout(self, plan: StepPlan) -> bool:
        """The step's verify chunks run as decode tokens (VerifySteps): no prefill chunk, no images."""
        return bool(plan.verify) and not plan.prefill and self.verify_steps is not None and self.images is None

    def _draft(self, plan: StepPlan) -> int:
        """spec.method=draft: the draft proposes the verify chunks' tokens, then computes the KV of the
        step's tokens, as the model is about to: a step without prefill chunks in the verify steps' layout
        (one padded step, a graph on a GPU), else the step's eager batch. The proposals stay on the device where
        both the mirror and the verify step read them there and every verifying row is greedy (its verdict is the
        model's tokens: the host needs no proposal); sampled verification reads them from the chunks. → the
        proposals a chunk has on the device (0: they are in the chunks)."""
        padded_mirror = not plan.prefill and self.draft_mirror is not None and self.images is None
        on_device = (padded_mirror and self._verify_layout(plan)
                     and all(self.sampling.greedy[c.row] for c in plan.verify))
        proposed = self.drafter.num_tokens if self.drafter.propose(plan.verify, on_device=on_device) else 0
        if padded_mirror:  # the logits are not needed
            self.draft_mirror.run(verify_tokens(plan, list(self.seq_len), proposed))
            return proposed
        seq_len = list(self.seq_len)
        batch, _ = self.build_batch(plan)
        self.seq_len[:] = seq_len  # the model's own step advances them
        self.drafter.mirror(batch)
        return proposed

    @torch.inference_mode()
    def sample_deferred(self, pending: PendingStep) -> None:
        """A deferred step's sampling, now that its rows have accepted every earlier token."""
        logits, pending.deferred = pending.deferred, None
        t0 = time.perf_counter()
        self._sample(pending, logits)
        pending.launch_s += time.perf_counter() - t0  # the trace's host time includes the masks' fill

    def _sample(self, pending: PendingStep, logits: torch.Tensor) -> None:
        rows = pending.rows
        tokens = self.sampling.sample(logits, rows, self.sampling.bitmask(rows))
        self.last_token[self._tensor(rows)] = tokens
        self._sampled(pending, logits, tokens)

    def _sampled(self, pending: PendingStep, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        logprobs = self.sampling.logprobs(logits, pending.rows, tokens)
        if self.device.type == "cuda":
            tokens = to_host_async(tokens)
            if logprobs is not None:  # read after the next step is launched: copy now, not then
                chosen, vals, ids, wants = logprobs
                logprobs = (to_host_async(chosen), None if vals is None else to_host_async(vals),
                            None if ids is None else to_host_async(ids), wants)
            pending.done = torch.cuda.Event(enable_timing=self.timed)
            pending.done.record()
        pending.tokens, pending.logprobs = tokens, logprobs

    def _scored(self, pending: PendingStep, scores: torch.Tensor) -> None:
        if self.device.type == "cuda":
            scores = to_host_async(scores)
            pending.done = torch.cuda.Event(enable_timing=self.timed)
            pending.done.record()
        pending.scores = scores

    def finish(self, pending: PendingStep) -> StepResult:
        if pending.done is not None:
            pending.done.synchronize()
        if pending.scores is not None:
            return StepResult(step=pending.step, rows=pending.rows, token_ids=[], scores=pending.scores.tolist(),
                              forward_s=time.perf_counter() - pending.t0)
        self.prompt_logprobs.collect(pending.prompt)
        verified = [] if pending.verify is None else self.verifier.collect(pending.verify, self.seq_len)
        if pending.tokens is None:
            return self._timings(pending, StepResult(step=pending.step, rows=[], token_ids=[], verified=verified))
        result = StepResult(step=pending.step, rows=pending.rows, token_ids=pending.tokens.tolist(), verified=verified)
        self.sampling.accept(pending.rows, result.token_ids)
        if pending.logprobs is not None:
            result.logprobs, result.top_ids, result.top_logprobs = logprobs_to_host(pending.logprobs)
        if pending.prompt_takers:
            result.prompt_logprobs = self.prompt_logprobs.take(pending.prompt_takers, len(pending.rows))
        return self._timings(pending, result)

    @staticmethod
    def _timings(pending: PendingStep, result: StepResult) -> StepResult:
        result.forward_s = time.perf_counter() - pending.t0
        if pending.start_event is not None and pending.done is not None:
            result.started, result.launch_s = pending.started, pending.launch_s
            result.device_s = pending.start_event.elapsed_time(pending.done) / 1e3
        return result

    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    def ready(self, pending: PendingStep) -> bool:
        return pending.done is None or pending.done.query()
