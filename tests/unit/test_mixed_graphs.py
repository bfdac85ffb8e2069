"""A step replayed piecewise (runtime/worker/mixed_graphs.py: padded to its token bucket, the pieces between
attentions from static buffers, the attentions between them) computes what the eager step computes. On CPU
MixedGraphs runs its padded pieces eagerly (no capture), so these tests check the cut and the padding: the
scratch slot takes the padding tokens' K/V, every real slot holds the eager step's K/V, and the logits (through
greedy tokens and their top logprobs) are the eager step's, for mixed steps, several chunks at once, a chunk
continuing a cached prefix and decode-only steps; across families whose pieces differ (q/k norms, Gemma's
sandwich norms and local rope, Phi-3's fused projections and partial rotary, MoE blocks) and an fp8 KV cache.
The capture runs on a GPU (tests/gpu/test_mixed_graphs_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.runtime.ipc.messages import NewSeq, PrefillChunk, SamplingParams, StepPlan
from llaunch.runtime.models.loader import build_model
from llaunch.runtime.worker.mixed_graphs import MixedGraphs, bucket_sizes
from llaunch.runtime.worker.runner import ModelRunner

ROWS, SLOTS, MAX_LEN = 4, 200, 96
SCRATCH = SLOTS  # the extra slot the worker allocates for padding


def test_buckets_every_64_tokens_to_512_then_every_128():
    assert bucket_sizes(0) == []
    assert bucket_sizes(1) == bucket_sizes(64) == [64]
    assert bucket_sizes(65) == [64, 128]
    assert bucket_sizes(512) == list(range(64, 513, 64))
    assert bucket_sizes(513) == [*range(64, 513, 64), 640]
    assert bucket_sizes(4352)[-1] == 4352 and len(bucket_sizes(4352)) == 8 + 30


def plans() -> list[StepPlan]:
    """Rows 0..2: A prefills alone; then A decodes beside B's first chunk (no sample), beside B's last
    chunk (continuing its 30 cached tokens) and all of C; then A, B and C decode together."""
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, logprobs=True, top_logprobs=3)
    prompt = {0: list(range(3, 23)), 1: list(range(40, 81)), 2: [7, 9, 11, 13, 15, 17, 19]}
    base = {0: 0, 1: 60, 2: 130}  # each row's first slot (the scratch slot is SLOTS)
    length = {0: 0, 1: 0, 2: 0}

    def chunk(row, start, n, sample=True):
        length[row] = start + n
        ids = prompt[row][start:start + n]
        return PrefillChunk(row=row, token_ids=ids, start=start, slots=[base[row] + start + j for j in range(n)],
                            sample=sample)

    def decode(rows):
        slots = []
        for r in rows:
            slots.append(base[r] + length[r])
            length[r] += 1
        return dict(decode_rows=rows, decode_slots=slots)

    def new(row):
        return NewSeq(row=row, request_id=str(row), sampling=sp, prompt_ids=prompt[row])

    steps = [StepPlan(step=0, new=[new(0)], prefill=[chunk(0, 0, 20)])]
    steps.append(StepPlan(step=1, new=[new(1)], **decode([0]), prefill=[chunk(1, 0, 30, sample=False)]))
    steps.append(StepPlan(step=2, new=[new(2)], **decode([0]), prefill=[chunk(1, 30, 11), chunk(2, 0, 7)]))
    for s in range(3, 7):
        steps.append(StepPlan(step=s, **decode([0, 1, 2])))
    return steps


def serve(model, piecewise: bool):
    kv = model.make_kv_cache(SLOTS + 1, ROWS + 1, MAX_LEN)
    for t in kv.k + kv.v:
        t.fill_(float("nan") if t.dtype.is_floating_point else 0)  # slots no request owns stay NaN but scratch
    runner = ModelRunner(model, kv, ROWS, torch.device("cpu"))
    kv.req_to_slots[ROWS].fill_(SCRATCH)
    if piecewise:
        runner.mixed_graphs = MixedGraphs(model, kv, 128, scratch_slot=SCRATCH)
    return [runner.execute(plan) for plan in plans()], kv


FAMILIES = ["qwen2", "qwen3", "gemma3_text", "phi3", "qwen3_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    return build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)


def assert_same_steps(model):
    eager, eager_kv = serve(model, piecewise=False)
    padded, padded_kv = serve(model, piecewise=True)
    for a, b in zip(eager, padded):
        assert (a.rows, a.token_ids, a.top_ids) == (b.rows, b.token_ids, b.top_ids)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(b.top_logprobs), torch.tensor(a.top_logprobs), rtol=1e-5, atol=1e-5)
    for e, p in zip(eager_kv.k + eager_kv.v, padded_kv.k + padded_kv.v):
        real = torch.ones(SLOTS, dtype=torch.bool)
        assert torch.isnan(e[:SLOTS].float()).flatten(1).all(1).eq(torch.isnan(p[:SLOTS].float()).flatten(1).all(1)).all()
        real &= ~torch.isnan(e[:SLOTS].float()).flatten(1).all(1)
        torch.testing.assert_close(p[:SLOTS][real].float(), e[:SLOTS][real].float(), rtol=1e-5, atol=1e-5)
    return eager


def test_padded_pieces_compute_the_eager_steps(model):
    eager = assert_same_steps(model)
    assert sum(len(r.token_ids) for r in eager) == 1 + 1 + 3 + 4 * 3  # every sampled row came back


def test_padded_pieces_over_an_fp8_cache(tmp_path):
    """An fp8 KV cache: prefill attention reads the chunk's own K/V unrounded, from the pieces' static k and v."""
    from llaunch.runtime.config import CacheConfig, KvDType
    from llaunch.runtime.models.kv_fp8 import use_fp8_kv

    folder = write_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    model = build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)
    use_fp8_kv(model, CacheConfig(kv_dtype=KvDType.fp8_e4m3))
    assert model.kv_dtype == torch.float8_e4m3fn
    assert_same_steps(model)


def test_row_invariant_runs_small_steps_unpadded(tmp_path, kernel_settings, monkeypatch):
    """kernels.row_invariant: a step of up to 16 tokens runs unpadded (its bucket's 64 rows would send its linears to
    cuBLAS, where a row's sums depend on the step), larger ones still replay their bucket; the outputs are the same."""
    folder = write_tiny_checkpoint(tmp_path / "qwen2", "qwen2")
    model = build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)
    replayed = []
    real = MixedGraphs.run
    monkeypatch.setattr(MixedGraphs, "run", lambda self, batch: replayed.append(batch.num_tokens) or real(self, batch))
    outputs = {}
    for invariant in (False, True):
        kernel_settings(row_invariant=invariant)
        replayed.clear()
        outputs[invariant] = [(r.rows, r.token_ids) for r in serve(model, piecewise=True)[0]]
        # steps of 20, 31 and 19 tokens, then four decode steps of 3 rows
        assert replayed == ([20, 31, 19] if invariant else [20, 31, 19, 3, 3, 3, 3])
    assert outputs[True] == outputs[False]
