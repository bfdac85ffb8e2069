"""Turns a StepPlan into a ForwardBatch, runs the model and samples. The worker keeps each row's
last sampled token and length, so a decode step needs nothing from the router but slot ids."""
from __future__ import annotations

import time

import torch

from llaunch.runtime.ipc.messages import StepPlan, StepResult
from llaunch.runtime.models.batch import ForwardBatch, KvCache
from llaunch.runtime.worker.sampling_state import SamplingState


class ModelRunner:
    def __init__(self, model, kv: KvCache, max_rows: int, device: torch.device):
        self.model = model
        self.kv = kv
        self.device = device
        self.max_rows = max_rows
        self.sampling = SamplingState(max_rows, model.arch.vocab_size, device)
        self.last_token = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.seq_len = [0] * max_rows  # tokens in the KV cache per row (host mirror)

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, list[int]]:
        """The forward inputs, and the rows whose next token is sampled (in logits order)."""
        for new in plan.new:
            self.sampling.set_row(new.row, new.sampling, new.prompt_ids)
            self.seq_len[new.row] = 0
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
        for chunk in plan.prefill:
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
            self.seq_len[chunk.row] = chunk.start + n
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
            logits_index=self._tensor(logits_index),
            num_decode=nd,
            num_prefill_tokens=len(prefill_ids),
            max_prefill_len=max(q_lens, default=0),
            max_decode_len=max(decode_lens, default=0),
        )
        return batch, sampled_rows

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        batch, rows = self.build_batch(plan)
        if batch.num_tokens == 0:
            return StepResult(step=plan.step, rows=[], token_ids=[])
        logits = self.model.forward(batch, self.kv)
        if not rows:
            return StepResult(step=plan.step, rows=[], token_ids=[], forward_s=time.perf_counter() - t0)
        tokens = self.sampling.sample(logits, rows)
        self.last_token[self._tensor(rows)] = tokens
        result = StepResult(step=plan.step, rows=rows, token_ids=tokens.tolist())
        lp = self.sampling.logprobs(logits, rows, tokens)
        if lp is not None:
            result.logprobs, result.top_ids, result.top_logprobs = lp
        result.forward_s = time.perf_counter() - t0
        return result
