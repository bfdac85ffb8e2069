"""Speculative decoding, the worker's half: a VerifyChunk's k+1 positions ran as one chunk over the
row's cached KV; sampling them decides how much of the proposal the model keeps.

Greedy: the proposal's longest prefix equal to the argmax at each position, then the argmax after it
(token-identical to decoding one token at a time). Sampled: rejection sampling with a point-mass
draft (an n-gram proposal): proposed token d is accepted with probability p(d) under the target's
filtered distribution (temperature, top-k, top-p, as kernels.sample draws), and at the first rejection
a token is drawn from p with d removed (renormalised); if all are accepted, one more is drawn from the
last position. Each output token is then distributed exactly as the target's. Noise is a hash of the
row's seed and token offset (kernels' counter-based noise), so every tp rank draws the same tokens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from llaunch.kernels.reference import _uniform_noise
from llaunch.runtime.ipc.messages import VerifyChunk
from llaunch.runtime.worker.sampling_state import SamplingState
from llaunch.runtime.worker.transfer import to_device, to_host_async

ACCEPT_SALT = 0x2545F491  # the acceptance draws' noise stream, apart from the token draws'


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                   top_k: torch.Tensor) -> torch.Tensor:
    """[n, V] float32: the distribution kernels.sample draws from (temperature, then top-k and top-p
    over the sorted probabilities, the most likely token always kept), renormalised. The settings
    are 0-d or [n, 1]."""
    vocab = logits.shape[-1]
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    keep = (rank < k) & ((sorted_p.cumsum(-1) - sorted_p) < top_p)
    keep[:, 0] = True
    kept = torch.zeros_like(probs).scatter_(1, order, sorted_p.masked_fill(~keep, 0.0))
    return kept / kept.sum(dim=-1, keepdim=True)


def _outcome(draft: torch.Tensor, accepted: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """[B, n] tokens: per row the first `accepted` proposed ones, then own[accepted], then -1 padding.
    draft [B, n-1], accepted [B], own [B, n]."""
    b, n = own.shape
    idx = torch.arange(n, device=own.device)[None, :]
    padded = torch.cat([draft, draft.new_full((b, 1), -1)], dim=1)
    mine = own.gather(1, accepted[:, None]).expand(b, n)
    acc = accepted[:, None]
    return torch.where(idx < acc, padded, torch.where(idx == acc, mine, torch.full_like(own, -1)))


def verify_greedy(logits: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """logits [m+1, V] at the row's last token and each proposed token; draft [m] → [m+1] (-1 padded)."""
    best = torch.argmax(logits, dim=-1)
    accepted = torch.cumprod((best[:-1] == draft).long(), 0).sum()
    return _outcome(draft[None], accepted[None], best[None])[0]


def greedy_verdict(logits: torch.Tensor, tokens: torch.Tensor, verifying: torch.Tensor, starts: torch.Tensor,
                   rows: torch.Tensor, last_token: torch.Tensor, scratch_row: int) -> torch.Tensor:
    """verify_greedy of every chunk of a step laid out as decode tokens (runtime/worker/verify_graphs.py:
    input tokens [T], whether each is a verify chunk's [T], each token's chunk start [T] and row [T]), in ops of
    fixed shapes (a CUDA graph's): [T] the model's token at each position all of whose chunk's earlier proposed
    tokens were kept, else -1, so a chunk reads as its kept proposal, then the model's own token; each verify
    chunk's row's last token is set to that one (a decode row is a chunk of one token whose row's is left to its
    sampling; scratch_row takes the writes of the other positions)."""
    best = torch.argmax(logits, dim=-1)
    follows = torch.cat([tokens[1:], tokens.new_full((1,), -2)])  # the proposed token after each position
    same_chunk = torch.cat([starts[1:] == starts[:-1], starts.new_zeros(1, dtype=torch.bool)])
    stop = ((best != follows) | ~same_chunk).long()  # the model parts from its chunk's proposal after here
    before = torch.cumsum(stop, 0) - stop  # stops strictly before each position, over the whole step
    kept = before == before[starts]  # none since the chunk's first token
    end = kept & (stop == 1) & verifying  # each chunk's last kept position (not a decode row's: it is sampled)
    last_token.index_put_((torch.where(end, rows, torch.full_like(rows, scratch_row)),), best)
    return torch.where(kept, best, torch.full_like(best, -1))


def verify_sampled(logits: torch.Tensor, draft: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                   top_k: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """Rejection sampling of proposals draft [B, m] against logits [B, m+1, V]; per row settings,
    seed and noise offset [B] (position j draws at offset + j). → [B, m+1] tokens, -1 padded."""
    b, n, vocab = logits.shape
    m = n - 1
    per_pos = lambda x: x.reshape(b, 1).expand(b, n).reshape(b * n, 1)  # noqa: E731
    probs = filtered_probs(logits.reshape(b * n, vocab), per_pos(temperature), per_pos(top_p),
                           per_pos(top_k)).reshape(b, n, vocab)
    offsets = (offset.reshape(b, 1) + torch.arange(n, device=logits.device)).reshape(-1)
    seeds = per_pos(seed).reshape(-1)
    u = _uniform_noise(seeds ^ ACCEPT_SALT, offsets, 1).reshape(b, n)
    accept = u[:, :m] < probs[:, :m].gather(2, draft[..., None])[..., 0]
    accepted = torch.cumprod(accept.long(), 1).sum(1)
    residual = probs.clone()
    residual[:, :m].scatter_(2, draft[..., None], 0.0)  # p − q with q a point mass at the proposed token, clipped at 0
    race = residual.double() / -torch.log(_uniform_noise(seeds, offsets, vocab).reshape(b, n, vocab))
    return _outcome(draft, accepted, torch.argmax(race, dim=-1))  # the exponential race draws from `residual`


@dataclass
class PendingVerify:
    chunks: list[VerifyChunk]
    tokens: torch.Tensor  # [chunks, k+1] int64, -1 padded (on the host once `done` fires); flat: the chunks' in a row
    done: Optional[torch.cuda.Event]
    flat: bool = False  # tokens [sum of the chunks' lengths], greedy_verdict's


class Verifier:
    def __init__(self, sampling: SamplingState, last_token: torch.Tensor, device: torch.device):
        self.sampling, self.last_token, self.device = sampling, last_token, device

    def launch(self, logits: torch.Tensor, chunks: list[VerifyChunk],
               verdict: Optional[torch.Tensor] = None) -> PendingVerify:
        """Enqueue the verdicts of `chunks` (their logits in plan order); each row's last token is its
        last kept one, on the device. `verdict`: the chunks' greedy verdict (greedy_verdict's, the rows' last
        tokens set), which a step of greedy rows only takes."""
        s = self.sampling
        width = max(len(c.token_ids) for c in chunks)
        starts = [0]
        for c in chunks:
            starts.append(starts[-1] + len(c.token_ids))
        greedy = [i for i, c in enumerate(chunks) if s.greedy[c.row]]
        if len(greedy) == len(chunks):  # all greedy (the common case): judged in the step, or one batch of kernels
            if verdict is not None:
                return self._pending(chunks, verdict, flat=True)
            return self._pending(chunks, self._greedy_rows(logits, chunks, starts, greedy, width))
        out = torch.full((len(chunks), width), -1, dtype=torch.int64, device=self.device)
        if greedy:
            out[to_device(greedy, torch.int64, self.device)] = self._greedy_rows(logits, chunks, starts, greedy, width)
        for i, chunk in enumerate(chunks):
            n, row = len(chunk.token_ids), chunk.row
            if s.greedy[row]:
                continue
            block = logits[starts[i]:starts[i] + n]
            draft = to_device(chunk.token_ids[1:], torch.int64, self.device)
            one = slice(row, row + 1)
            tokens = verify_sampled(block[None], draft[None], s.temperature[one], s.top_p[one], s.top_k[one],
                                    s.seed[one], to_device([s.generated[row]], torch.int64, self.device))[0]
            out[i, :n] = tokens
            kept = (tokens >= 0).sum()
            self.last_token[row:row + 1] = tokens.gather(0, (kept - 1)[None])
        return self._pending(chunks, out)

    def _greedy_rows(self, logits: torch.Tensor, chunks: list[VerifyChunk], starts: list[int], which: list[int],
                     width: int) -> torch.Tensor:
        """verify_greedy for chunks `which` at once (a verify step of 16 rows: ~10 kernels, not ~160):
        [len(which), width] tokens, -1 padded; the rows' last tokens set. One upload carries each
        chunk's logits rows (a short chunk repeats its last), its proposal padded with -2 (never a
        token, so never accepted) and its row."""
        host = []
        for i in which:
            c = chunks[i]
            n = len(c.token_ids)
            host += [starts[i] + min(j, n - 1) for j in range(width)]
            host += c.token_ids[1:] + [-2] * (width - n)
            host.append(c.row)
        packed = to_device(host, torch.int64, self.device).view(len(which), 2 * width)
        index, draft, rows = packed[:, :width], packed[:, width:2 * width - 1], packed[:, -1]
        best = torch.argmax(logits, dim=-1)[index]  # [G, width]: the model's token at each position
        accepted = torch.cumprod((best[:, :-1] == draft).long(), 1).sum(1)
        self.last_token[rows] = best.gather(1, accepted[:, None])[:, 0]
        return _outcome(draft, accepted, best)

    def _pending(self, chunks: list[VerifyChunk], out: torch.Tensor, flat: bool = False) -> PendingVerify:
        done = None
        if self.device.type == "cuda":
            out = to_host_async(out)
            done = torch.cuda.Event()
            done.record()
        return PendingVerify(chunks, out, done, flat)

    def collect(self, pending: PendingVerify, seq_len: list[int]) -> list[list[int]]:
        """Each chunk's kept tokens; the rows' lengths and noise counters follow them."""
        if pending.done is not None:
            pending.done.synchronize()
        verdicts = []
        if pending.flat:
            flat, offsets = pending.tokens.tolist(), [0]
            for chunk in pending.chunks:
                offsets.append(offsets[-1] + len(chunk.token_ids))
            per_chunk = [flat[a:b] for a, b in zip(offsets, offsets[1:])]
        else:
            per_chunk = pending.tokens.tolist()
        for chunk, row_tokens in zip(pending.chunks, per_chunk):
            kept = [t for t in row_tokens if t >= 0]
            seq_len[chunk.row] = chunk.start + len(kept)  # the last kept token's KV is computed next step
            self.sampling.generated[chunk.row] += len(kept)
            verdicts.append(kept)
        return verdicts
