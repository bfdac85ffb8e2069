"""The worker's side of audio (Qwen2-Audio): each row's clip embeddings and where they sit in its
prompt, spliced into a step's ForwardBatch at those tokens. Positions stay the plain 1-D ones (no
M-RoPE: delta 0). The same interface as ImageRows (runtime/worker/image_rows.py), so the runner takes
either as `images`."""
from __future__ import annotations

import torch

from llaunch.runtime.ipc.messages import NewSeq, StepPlan
from llaunch.runtime.models.batch import ForwardBatch


class AudioRows:
    def __init__(self, source):
        """`source.embeddings(clips)`: each clip's embeddings (runtime/encoder/in_process.py in-process)."""
        self.source = source
        self.rows: dict[int, list[tuple[int, torch.Tensor]]] = {}  # (offset in the prompt, embeddings) per clip

    def start(self, new: NewSeq) -> None:
        if not new.images:
            self.rows.pop(new.row, None)
            return
        embeds = self.source.embeddings(new.images)
        self.rows[new.row] = [(c.offset, e) for c, e in zip(new.images, embeds)]

    def has(self, row: int) -> bool:
        return row in self.rows

    def delta(self, row: int) -> int:
        return 0

    def decorate(self, batch: ForwardBatch, plan: StepPlan) -> ForwardBatch:
        """Give the tokens of clips inside this step's prefill chunks their embeddings."""
        if not self.rows:
            return batch
        index, embeds, offset = [], [], len(plan.decode_rows)
        for chunk in plan.prefill:
            n = len(chunk.token_ids)
            for start, e in self.rows.get(chunk.row, ()):  # the part of each clip inside this chunk
                a, b = max(start, chunk.start), min(start + e.shape[0], chunk.start + n)
                if a < b:
                    index.extend(range(offset + a - chunk.start, offset + b - chunk.start))
                    embeds.append(e[a - start:b - start])
            offset += n
        if index:
            batch.image_index = torch.tensor(index, dtype=torch.int64, device=batch.positions.device)
            batch.image_embeds = torch.cat(embeds)
        return batch
