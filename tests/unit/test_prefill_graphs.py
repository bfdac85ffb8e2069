"""A lone prefill padded to its CUDA-graph bucket computes what the unpadded step computes. On CPU
PrefillGraphs runs its padded step eagerly (no capture), so these tests check the padding: the
scratch slot and row take the padding tokens, attention stops at the real length, and only the last
real token's logits come back. The capture itself runs on a GPU (tests/gpu/test_qwen2_7b_shape.py)."""
import pytest
import torch

from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.runtime.ipc.messages import NewSeq, PrefillChunk, SamplingParams, StepPlan
from llaunch.runtime.models.loader import build_model
from llaunch.runtime.worker.prefill_graphs import PrefillGraphs, alone_chunk, bucket_sizes
from llaunch.runtime.worker.runner import ModelRunner

ROWS, SLOTS, MAX_LEN = 2, 96, 96
SCRATCH = SLOTS  # the extra slot the worker allocates for padding


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")
    return build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)


def test_buckets_are_whole_multiples_of_64_tokens():
    assert bucket_sizes(0) == []
    assert bucket_sizes(1) == bucket_sizes(64) == [64]
    assert bucket_sizes(65) == [64, 128]
    assert bucket_sizes(1024)[-1] == 1024 and len(bucket_sizes(1024)) == 16


def test_only_a_prompts_last_chunk_running_alone_takes_a_graph():
    chunk = lambda n, sample=True, row=0: PrefillChunk(row=row, token_ids=[1] * n, start=0,  # noqa: E731
                                                      slots=list(range(n)), sample=sample)
    assert alone_chunk(StepPlan(step=0, prefill=[chunk(10)]), 64) is not None
    assert alone_chunk(StepPlan(step=0, prefill=[chunk(64)]), 64) is not None
    assert alone_chunk(StepPlan(step=0, prefill=[chunk(65)]), 64) is None  # longer than the largest bucket
    assert alone_chunk(StepPlan(step=0, prefill=[chunk(10, sample=False)]), 64) is None  # more chunks follow
    assert alone_chunk(StepPlan(step=0, prefill=[chunk(10), chunk(5, row=1)]), 64) is None
    assert alone_chunk(StepPlan(step=0, prefill=[chunk(10)], decode_rows=[1], decode_slots=[40]), 64) is None
    assert alone_chunk(StepPlan(step=0, decode_rows=[1], decode_slots=[40]), 64) is None


def _serve(model, padded: bool, prompt: list[int], first_chunk: int, steps: int = 6, **sampling):
    """One request: its prompt in two chunks (the second alone, after a first of `first_chunk`
    tokens; 0: one chunk), then greedy decode steps. Returns the results and the K/V cache."""
    kv = model.make_kv_cache(SLOTS + 1, ROWS + 1, MAX_LEN)
    for t in kv.k + kv.v:
        t.fill_(float("nan"))  # every slot the request does not own stays NaN, but the scratch slot
    runner = ModelRunner(model, kv, ROWS, torch.device("cpu"))
    kv.req_to_slots[ROWS].fill_(SCRATCH)
    if padded:
        runner.prefill_graphs = PrefillGraphs(model, kv, 64, scratch_row=ROWS, scratch_slot=SCRATCH)
    row, n = 1, len(prompt)
    slots = list(range(10, 10 + n))  # not starting at 0: a padding token must not land in slot 0
    sp = SamplingParams(max_new_tokens=steps, temperature=0.0, **sampling)
    new = [NewSeq(row=row, request_id="r", sampling=sp, prompt_ids=prompt)]
    plans = []
    if first_chunk:
        plans.append(StepPlan(step=0, new=new, prefill=[PrefillChunk(row=row, token_ids=prompt[:first_chunk], start=0,
                                                                     slots=slots[:first_chunk], sample=False)]))
        new = []
    plans.append(StepPlan(step=len(plans), new=new, prefill=[
        PrefillChunk(row=row, token_ids=prompt[first_chunk:], start=first_chunk, slots=slots[first_chunk:],
                     sample=True)]))
    results = [runner.execute(p) for p in plans]
    free = 10 + n
    for step in range(steps - 1):
        results.append(runner.execute(StepPlan(step=len(plans) + step, decode_rows=[row], decode_slots=[free])))
        free += 1
    return results, kv, free


@pytest.mark.parametrize("first_chunk, n", [(0, 5), (0, 64), (7, 19)],
                         ids=["short", "a whole bucket", "after a prefix"])
def test_a_padded_prefill_serves_the_tokens_the_eager_one_does(model, first_chunk, n):
    prompt = [(37 * i + 11) % 200 + 3 for i in range(n)]
    padded, kv_padded, free = _serve(model, True, prompt, first_chunk, logprobs=True, top_logprobs=3)
    eager, kv_eager, _ = _serve(model, False, prompt, first_chunk, logprobs=True, top_logprobs=3)
    assert [r.token_ids for r in padded] == [r.token_ids for r in eager]
    assert [r.top_ids for r in padded] == [r.top_ids for r in eager]
    for p, e in zip(padded, eager):
        assert p.logprobs == pytest.approx(e.logprobs, abs=1e-5)
    for k_p, k_e in zip(kv_padded.k + kv_padded.v, kv_eager.k + kv_eager.v):
        torch.testing.assert_close(k_p[10:free], k_e[10:free], rtol=1e-5, atol=1e-5)  # the request's K/V
        owned = torch.zeros(SLOTS + 1, dtype=torch.bool)
        owned[10:free] = True
        owned[SCRATCH] = True
        assert k_p[~owned].isnan().all()  # padding wrote the scratch slot only
    assert (kv_padded.req_to_slots[ROWS] == SCRATCH).all()  # and the scratch row still points there
    assert torch.equal(kv_padded.req_to_slots[1, :free - 10], kv_eager.req_to_slots[1, :free - 10])
