"""Launching a step never waits for the device: the worker enqueues step N+1 while step N runs, so a
launch that synchronizes (a `.item()`, a copy to pageable memory, a pinned allocation that waits)
serializes host and device. Each step kind is launched behind a long device sleep and under torch's
sync debug mode, which raises at the synchronizing call; and the launched step must not read as ready
while the device is busy (the worker's loop takes the next plans until then, where `finish` would block it)."""
from __future__ import annotations

import time

import pytest
import torch

from gpu.conftest import profile_shape
from llaunch.runtime.ipc.messages import NewSeq, PrefillChunk, SamplingParams, StepPlan, VerifyChunk

ROWS, SLOTS, MAX_LEN = 8, 8192, 2048
SLEEP_CYCLES = 2_000_000_000  # ~1 s of device time on an H200's clock


@pytest.fixture(scope="module")
def runner():
    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.decoder import DecoderLM
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.weights import DummySource, load_from
    from llaunch.runtime.worker.runner import ModelRunner

    shape = dict(profile_shape("qwen2-7b"), num_hidden_layers=2)
    model = DecoderLM(ModelArch.from_hf_config(shape), TpGroup(0, 1, None), torch.device("cuda"), torch.bfloat16,
                      MAX_LEN).eval()
    load_from(model, DummySource(0, torch.device("cuda"), full_tensors=False))
    kv = model.make_kv_cache(SLOTS + 1, ROWS + 1, MAX_LEN)
    return ModelRunner(model, kv, ROWS, torch.device("cuda"), cuda_graphs=True, prefill_graph_tokens=512,
                       mixed_graph_tokens=1024, verify_tokens=16)


def plans(first_row: int, first_slot: int, first_step: int) -> list[tuple[str, StepPlan]]:
    """A lone prefill (its graph), a mixed step (piecewise graphs), a decode step (its graph), a mixed step with
    a one-token chunk and a sampling request, several chunks at once, and speculative decoding's verify steps (a
    verify chunk alone, as at batch 1, and beside decode rows: the verify graphs); on rows first_row..+3."""
    greedy = SamplingParams(max_new_tokens=64, temperature=0.0)
    sampled = SamplingParams(max_new_tokens=64, temperature=0.8, top_p=0.9, seed=3)
    slots = iter(range(first_slot, SLOTS))
    r0, r1, r2, r3 = range(first_row, first_row + 4)
    s = first_step

    def chunk(row, n, start=0, sample=True):
        return PrefillChunk(row=row, token_ids=list(range(100, 100 + n)), start=start,
                            slots=[next(slots) for _ in range(n)], sample=sample)

    def new(row, sp, n):
        return NewSeq(row=row, request_id=str(row), sampling=sp, prompt_ids=list(range(100, 100 + n)))

    def decode(rows):
        return dict(decode_rows=rows, decode_slots=[next(slots) for _ in rows])

    def verify(row, start, n):  # the row's last token and a proposal of n - 1 tokens at its `start` cached tokens
        return VerifyChunk(row=row, token_ids=list(range(100, 100 + n)), start=start, slots=[next(slots) for _ in range(n)])

    return [
        ("lone prefill", StepPlan(step=s, new=[new(r0, greedy, 300)], prefill=[chunk(r0, 300)])),
        ("mixed", StepPlan(step=s + 1, new=[new(r1, sampled, 700)], prefill=[chunk(r1, 700)], **decode([r0]))),
        ("decode", StepPlan(step=s + 2, **decode([r0, r1]))),
        ("mixed, chunks of 1 and 1000 tokens", StepPlan(
            step=s + 3, new=[new(r2, greedy, 1001), new(r3, sampled, 1)],
            prefill=[chunk(r2, 1000, sample=False), chunk(r3, 1)], **decode([r0, r1]))),
        ("mixed, a prompt's last token", StepPlan(step=s + 4, prefill=[chunk(r2, 1, start=1000)],
                                                  **decode([r0, r1, r3]))),
        # r0 holds 300 prompt tokens and 4 decoded ones; r2 1001 prompt tokens
        ("verify alone", StepPlan(step=s + 5, verify=[verify(r0, 304, 5)])),
        ("verify beside decode rows", StepPlan(step=s + 6, verify=[verify(r2, 1001, 3)], **decode([r1, r3]))),
    ]


def test_launches_neither_synchronize_nor_wait_for_the_device(runner):
    for _, plan in plans(0, 0, 0):  # the kernels each step kind needs are built (JIT) before timing
        runner.finish(runner.launch(plan))
    for name, plan in plans(4, SLOTS // 2, 7):
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # the device is busy for ~1 s from here
        torch.cuda.set_sync_debug_mode("error")
        try:
            t0 = time.perf_counter()
            pending = runner.launch(plan)
            launch_s = time.perf_counter() - t0
        finally:
            torch.cuda.set_sync_debug_mode(0)
        busy = not torch.cuda.current_stream().query()
        waits = not runner.ready(pending)
        runner.finish(pending)
        assert busy and launch_s < 0.25, f"{name}: the launch took {launch_s:.3f} s behind a busy device"
        assert waits, f"{name}: the step reads as ready behind a busy device (finish would block the worker's loop)"
