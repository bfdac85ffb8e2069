"""Prompt logprobs with the scheduler and the model runner in one process (tiny random Qwen2, float32):
the samples of one prompt (n, best_of) compute them once and share them (runtime/http/prompt_logprob_sharing.py:
the others' deltas wait for the first sample's, then each opens with them), and a request that ends before its first token leaves no row in the worker's prompt-logprob table."""
import random

import pytest
import torch

from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.runtime.http.openai_protocol import Choice
from llaunch.runtime.http.prompt_logprob_sharing import SharedPromptLogprobs, ask_once
from llaunch.runtime.ipc.messages import AddRequest, SamplingParams
from llaunch.runtime.models.loader import build_model
from llaunch.runtime.router.request import Request
from llaunch.runtime.router.scheduler import Scheduler, SchedulerLimits
from llaunch.runtime.worker.runner import ModelRunner

PROMPT = [random.Random(4).randrange(100, 900) for _ in range(20)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")
    return build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)


def engine(model, prompt_logprob_tokens=256):
    sched = Scheduler(SchedulerLimits(kv_slots=300, max_running=4, batch_max_tokens=64, chunked_prefill=True,
                                      chunked_prefill_size=64, max_wait_tokens=1, token_ratio=0.0, max_model_len=128,
                                      eos_ids=(), prompt_cache=True, prompt_logprob_tokens=prompt_logprob_tokens))
    return sched, ModelRunner(model, model.make_kv_cache(301, 5, 128), 4, torch.device("cpu"))


def add(sched, rid, sampling):
    sched.add(Request(AddRequest(request_id=rid, frontend=0, prompt_ids=PROMPT, sampling=sampling, arrival_time=0.0),
                      sampling))


def run(sched, runner) -> dict:
    deltas = {}
    while sched.has_work():
        for d in sched.on_result(runner.execute(sched.schedule())):
            deltas.setdefault(d.request_id, []).append(d)
    return deltas


def test_the_samples_of_a_prompt_compute_its_logprobs_once(model):
    sched, runner = engine(model)
    samples = [Choice(index=i, prompt=0, prompt_ids=PROMPT,
                      sampling=SamplingParams(max_new_tokens=3, temperature=0.8, seed=i, prompt_logprobs=2))
               for i in range(3)]
    asked = ask_once(samples)
    for c in asked:
        add(sched, str(c.index), c.sampling)
    deltas = run(sched, runner)
    assert runner.prompt_logprobs.positions == len(PROMPT) - 1  # one prompt's worth, not three
    relay = SharedPromptLogprobs(samples, asked)  # the others' deltas come first: held until sample 0's
    out = [pair for c in reversed(asked) for d in deltas[str(c.index)] for pair in relay.feed(c.index, d)]
    assert relay.drain() == []
    got = [[d.prompt_logprobs for i, d in out if i == c.index] for c in asked]
    assert [[d.token_ids for i, d in out if i == c.index] for c in asked] == \
        [[d.token_ids for d in deltas[str(c.index)]] for c in asked]  # each sample's own tokens, in order
    alone_sched, alone = engine(model)
    add(alone_sched, "alone", samples[2].sampling)  # what a sample computes by itself
    want = next(d.prompt_logprobs for d in run(alone_sched, alone)["alone"] if d.prompt_logprobs is not None)
    assert len(want.logprobs) == len(PROMPT) - 1 and len(want.top_ids[0]) == 2
    assert [g[0] for g in got] == [want] * 3 and not any(p for g in got for p in g[1:])  # with each first delta


def test_a_request_that_ends_before_its_first_token_leaves_no_prompt_logprob_row(model):
    sched, runner = engine(model, prompt_logprob_tokens=8)  # the prompt takes three steps
    add(sched, "asks", SamplingParams(max_new_tokens=3, prompt_logprobs=0))
    add(sched, "other", SamplingParams(max_new_tokens=8))  # keeps running: its steps carry the release
    sched.on_result(runner.execute(sched.schedule()))
    table = runner.prompt_logprobs
    assert table.asking and any(table.prompt) and any(table.parts)  # its first chunk's logprobs wait for the rest
    sched.abort("asks")
    plan = sched.schedule()
    assert plan.release_rows and not plan.new  # its row is not reused by this plan
    sched.on_result(runner.execute(plan))
    assert table.asking == set() and not any(table.prompt) and not any(table.parts)
