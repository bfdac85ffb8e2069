"""Speculative decoding with a draft model (spec.method=draft), the worker's half: a small model of
the same tokenizer proposes each verifying row's next tokens; the target verifies them as it does
n-gram proposals (runtime/worker/spec_verify.py).

The draft keeps its own KV cache in the target's slot space: the same slot ids, the same
`req_to_slots` table, its own K/V buffers. Every token the target computes, the draft computes
too (`mirror`: the step's batch through the draft, logits dropped), so wherever the target has KV
the draft has it as well: a prompt-cache hit, a shared prefix and a rejected proposal's freed slots
need nothing of their own. To propose, the draft decodes greedily from the row's last token, one
token a step for k steps, writing its KV into the slots the router allocated for the verify chunk;
the step's mirror then writes the last proposal's too.

The draft is replicated on every tp rank (it is small); the first rank's proposals are broadcast,
so every rank verifies the same tokens. Its k proposing steps run padded, as one CUDA graph per batch bucket
on a GPU (runtime/worker/draft_graphs.py). Where the verify step also runs in the verify steps' layout and every
verifying row is greedy, the proposals stay on the device: the mirror and the verify step read them there
(verify_graphs.verify_tokens' `proposed`) and the verdict alone comes back, so the host never waits for the draft
(on an H100 that wait held a k = 4 speculating step's enqueue at 1.0 ms of its 2.09). Otherwise they are read back
(one device sync a speculating step) into the chunks, which sampled verification needs. With spec.draft_ahead a
step whose proposals stayed on the device drafts its rows' next ones right behind its verdict (`propose_ahead`),
where the device would otherwise wait for the router's next plan; that plan takes them when it continues the same
rows in the same order (a row alone; more rows than a step keeps in flight alternate steps). The mirror of a step
without prefill chunks runs in the verify steps' layout, padded (runtime/worker/verify_graphs.py, the runner's
draft_mirror); of the others, eagerly."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from llaunch.runtime.ipc.messages import VerifyChunk
from llaunch.runtime.models.batch import ForwardBatch, KvCache
from llaunch.runtime.worker.draft_graphs import DraftSteps


class Drafter:
    def __init__(self, model, kv: KvCache, vocab_size: int, device: torch.device, group=None,
                 num_tokens: int = 0, max_batch: int = 0, ahead: bool = False):
        """`kv`: the draft's cache, sharing the target's req_to_slots. `vocab_size`: the target's embedding rows
        (a larger draft vocabulary's extra ids are never proposed). `group`: the replica's tp ranks, which all verify the first rank's proposals.
        `num_tokens`, `max_batch`: the most tokens a chunk proposes and chunks a step holds (spec.num_tokens,
        spec.max_batch), which the padded steps cover (`pad_steps`; 0: every proposal runs its steps unpadded).
        `ahead` (spec.draft_ahead): a step whose proposals stayed on the device drafts its rows' next ones behind
        its verdict (`propose_ahead`), into the `ahead_slots(...)` slots before the scratch slot, which the caller
        keeps out of the router's slots in both caches."""
        self.model, self.kv, self.device, self.group = model, kv, device, group
        self.vocab_size = min(vocab_size, model.arch.vocab_size)
        self.embed_rows = model.arch.vocab_size
        self.num_tokens, self.max_batch, self.ahead = num_tokens, max_batch, ahead
        self.steps: Optional[DraftSteps] = None
        self.kept_on_device = 0  # proposals left on the device for the verify step (tests read it)
        self.drafted_ahead = 0  # of those, drafted behind the step before's verdict (tests read it)
        self.ahead_runs = 0  # proposals drafted ahead, taken or not
        self._ahead_rows: Optional[list[int]] = None  # the rows whose next proposals are in `proposed()`

    @staticmethod
    def ahead_slots(num_tokens: int, max_batch: int) -> int:
        """The slots proposals drafted ahead write: k + 1 a chunk."""
        return (num_tokens + 1) * max_batch

    def pad_steps(self, max_len: int, scratch_row: int, scratch_slot: int, capture: bool) -> None:
        """Proposals of up to max_batch chunks run padded (`capture`: replayed from CUDA graphs)."""
        if self.num_tokens <= 0 or self.max_batch <= 0:
            self.ahead = False
            return
        first_ahead = scratch_slot - self.ahead_slots(self.num_tokens, self.max_batch)
        self.ahead = self.ahead and first_ahead >= 0
        self.steps = DraftSteps(self, self.num_tokens, self.max_batch, max_len, scratch_row, scratch_slot,
                                ahead_slot=first_ahead if self.ahead else -1)
        if capture:
            self.steps.capture()

    def _ids(self, ids: torch.Tensor) -> torch.Tensor:
        """A model with more embedding rows than the draft can sample an id the draft has no row for
        (a padding id): the draft reads token 0 there (its proposals may then miss; the output cannot)."""
        return torch.where(ids < self.embed_rows, ids, torch.zeros_like(ids))

    def _t(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def proposed(self) -> Optional[torch.Tensor]:
        """The flat buffer the padded steps leave proposals in ([chunks, num_tokens] in a step's chunk order), or
        None without padded steps."""
        return None if self.steps is None else self.steps.proposals.view(-1)

    @torch.inference_mode()
    def propose(self, chunks: list[VerifyChunk], on_device: bool = False) -> bool:
        """Each chunk's proposal, the draft's greedy continuation of its last token: with `on_device`, where the
        padded steps fit, left in `proposed()` (chunk i's at [i·num_tokens, ...), token_ids untouched; True),
        else written into token_ids[1:] (the router's placeholders; False). Proposals drafted ahead for the same
        rows in the same order stand: the plan alone decides, so every tp rank decides alike (a rank's host lengths
        may lag its device), and a row the router continued from fewer tokens than its verdict kept only proposes
        worse (the draft wrote table entries at and past the verdict's length, never inside the row's context)."""
        ahead, self._ahead_rows = self._ahead_rows, None
        if not chunks:
            return False
        if on_device and ahead == [c.row for c in chunks] and self.steps.fits(chunks):
            self.kept_on_device += 1
            self.drafted_ahead += 1
            return True
        if self.steps is not None and self.steps.fits(chunks):
            proposals = self.steps.run(chunks)
            if on_device:
                self._broadcast(proposals)
                self.kept_on_device += 1
                return True
            self._share(chunks, [len(c.token_ids) - 1 for c in chunks], proposals)
            return False
        wanted = [len(c.token_ids) - 1 for c in chunks]
        for c in chunks:  # the slots of the proposal's positions, which the draft's steps attend over
            self.kv.req_to_slots[c.row, c.start:c.start + len(c.slots)] = self._t(c.slots).to(self.kv.req_to_slots.dtype)
        current = self._ids(self._t([c.token_ids[0] for c in chunks]))  # each row's latest token, on the device
        proposals = torch.zeros((len(chunks), max(wanted)), dtype=torch.int64, device=self.device)
        for j in range(max(wanted)):
            live = [i for i, n in enumerate(wanted) if j < n]  # a row stops at its own room
            index = self._t(live)
            lens = [chunks[i].start + j + 1 for i in live]
            batch = ForwardBatch(
                input_ids=current[index], positions=self._t([n - 1 for n in lens]),
                out_slots=self._t([chunks[i].slots[j] for i in live]), decode_rows=self._t([chunks[i].row for i in live]),
                decode_seq_lens=self._t(lens), prefill_rows=self._t([]), prefill_q_starts=self._t([]),
                prefill_q_lens=self._t([]), prefill_prefix_lens=self._t([]), logits_index=self._t(range(len(live))),
                num_decode=len(live), num_prefill_tokens=0, max_decode_len=max(lens), every_token=True)
            nxt = torch.argmax(self.model.forward(batch, self.kv)[:, :self.vocab_size], dim=-1)
            current[index] = nxt
            proposals[index, j] = nxt
        self._share(chunks, wanted, proposals)
        return False

    @torch.inference_mode()
    def propose_ahead(self, chunks: list[VerifyChunk], verdict: torch.Tensor, last_token: torch.Tensor) -> None:
        """Draft the chunks' rows' next proposals right behind this step's greedy verdict of them (`verdict`, the
        rows' `last_token` set by it), into `proposed()`: the next step's `propose` takes them when its chunks
        continue the same rows in the same order (DraftSteps.run_ahead)."""
        if not self.ahead or self.steps is None or not chunks or not self.steps.fits(chunks):
            return
        self._broadcast(self.steps.run_ahead(chunks, verdict, last_token))
        self._ahead_rows = [c.row for c in chunks]
        self.ahead_runs += 1

    def _broadcast(self, proposals: torch.Tensor) -> None:
        """Every rank gets the first rank's proposals, in place (ranks verify the same tokens even if their
        drafts' roundings differed)."""
        if self.group is not None:
            import torch.distributed as dist

            dist.broadcast(proposals, src=dist.get_global_rank(self.group, 0), group=self.group)

    def _share(self, chunks: list[VerifyChunk], wanted: list[int], proposals: torch.Tensor) -> None:
        """Every rank's chunks get the first rank's proposals [chunks, ≥ max(wanted)]."""
        self._broadcast(proposals)
        for c, n, row in zip(chunks, wanted, proposals.tolist()):  # one read of every proposal
            c.token_ids[1:] = row[:n]

    @torch.inference_mode()
    def mirror(self, batch: ForwardBatch) -> None:
        """The draft computes (and caches) the KV of every token of the target's step `batch`."""
        if batch.num_tokens == 0:
            return
        self.model.forward(dataclasses.replace(batch, input_ids=self._ids(batch.input_ids), logits_index=batch.logits_index[:1],
                                               every_token=False), self.kv)


def draft_kv_cache(draft, kv: KvCache) -> KvCache:
    """The draft's K/V buffers for the model cache `kv`'s slots, indexed through its req_to_slots."""
    return dataclasses.replace(draft.make_kv_cache(kv.num_slots, 1, 1), req_to_slots=kv.req_to_slots)
