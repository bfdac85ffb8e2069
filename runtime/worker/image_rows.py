"""The worker's side of images (Qwen2-VL, Qwen2.5-VL): each row's image embeddings, M-RoPE
positions and image spans, and what a step's ForwardBatch needs of them.

The vision tower runs in the visual server processes (runtime/encoder/process.py): at the step that
admits a request, every tensor-parallel rank reads its images' embeddings from their shared-memory
embed cache, where the router's image gate made sure they are (runtime/router/image_gate.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llaunch.runtime.ipc.messages import NewSeq, StepPlan
from llaunch.runtime.models.batch import ForwardBatch
from llaunch.runtime.models.mrope import rope_index


@dataclass
class RowImages:
    positions: torch.Tensor  # [3, prompt_len] M-RoPE positions of the prompt (host)
    delta: int  # a token at sequence index i >= prompt_len has position i + delta
    spans: list[tuple[int, torch.Tensor]]  # (offset in the prompt, embeddings [tokens, hidden]) per image


class ImageRows:
    def __init__(self, source, merge: int | None = None):
        """`source.embeddings(images)`: each image's embeddings, read from the visual servers' embed
        cache (runtime/cache/embed_reader.py) or encoded in-process (runtime/encoder/in_process.py);
        `merge`: the tower's spatial merge size (None: the in-process source's)."""
        self.source = source
        self.merge = merge or source.merge
        self.rows: dict[int, RowImages] = {}

    def start(self, new: NewSeq) -> None:
        if not new.images:
            self.rows.pop(new.row, None)
            return
        positions, delta = rope_index(len(new.prompt_ids), [(im.offset, tuple(im.grid)) for im in new.images],
                                      self.merge)
        embeds = self.source.embeddings(new.images)
        self.rows[new.row] = RowImages(positions, delta, [(im.offset, e) for im, e in zip(new.images, embeds)])

    def has(self, row: int) -> bool:
        return row in self.rows

    def delta(self, row: int) -> int:
        r = self.rows.get(row)
        return 0 if r is None else r.delta

    def decorate(self, batch: ForwardBatch, plan: StepPlan) -> ForwardBatch:
        """Shift decode positions by their rows' deltas; give chunks of image rows their 3-D positions
        and image embeddings."""
        if not self.rows:
            return batch
        nd = len(plan.decode_rows)
        positions = batch.positions.clone()
        for i, r in enumerate(plan.decode_rows):
            if r in self.rows:
                positions[i] += self.rows[r].delta
        mrope, index, embeds, offset = None, [], [], nd
        for chunk in plan.prefill:
            n, r = len(chunk.token_ids), self.rows.get(chunk.row)
            if r is not None:
                if mrope is None:
                    mrope = positions.expand(3, -1).clone()
                mrope[:, offset:offset + n] = r.positions[:, chunk.start:chunk.start + n].to(mrope.device)
                for start, e in r.spans:  # the part of each image inside this chunk
                    a, b = max(start, chunk.start), min(start + e.shape[0], chunk.start + n)
                    if a < b:
                        index.extend(range(offset + a - chunk.start, offset + b - chunk.start))
                        embeds.append(e[a - start:b - start])
            offset += n
        for chunk in getattr(plan, "verify", ()):  # speculative tokens after a prompt with images: shifted
            n, r = len(chunk.token_ids), self.rows.get(chunk.row)
            if r is not None:
                positions[offset:offset + n] += r.delta
                if mrope is not None:
                    mrope[:, offset:offset + n] += r.delta
            offset += n
        batch.positions, batch.mrope_positions = positions, mrope
        if index:
            batch.image_index = torch.tensor(index, dtype=torch.int64, device=positions.device)
            batch.image_embeds = torch.cat(embeds)
        return batch
