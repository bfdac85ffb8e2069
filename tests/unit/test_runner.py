"""The worker's model runner driven by hand-written plans on CPU (tiny random Qwen2, float32)."""
import pytest
import torch

from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.runtime.ipc.messages import NewSeq, PrefillChunk, SamplingParams, StepPlan
from llaunch.runtime.models.loader import build_model
from llaunch.runtime.worker.runner import ModelRunner

ROWS, SLOTS, MAX_LEN = 2, 64, 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")
    return build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)


def sampled_tokens(model, seeds: list[int], prompt: list[int], steps: int) -> list[list[int]]:
    """Each seed's row samples `steps` tokens (temperature 1) after the same prompt."""
    runner = ModelRunner(model, model.make_kv_cache(SLOTS + 1, ROWS + 1, MAX_LEN), ROWS, torch.device("cpu"))
    n = len(prompt)
    new = [NewSeq(row=r, request_id=str(r), sampling=SamplingParams(max_new_tokens=steps, seed=s), prompt_ids=prompt)
           for r, s in enumerate(seeds)]
    chunks = [PrefillChunk(row=r, token_ids=prompt, start=0, slots=list(range(r * n, r * n + n)), sample=True)
              for r in range(len(seeds))]
    out = [runner.execute(StepPlan(step=0, new=new, prefill=chunks)).token_ids]
    free = len(seeds) * n
    for step in range(1, steps):
        rows = list(range(len(seeds)))
        out.append(runner.execute(StepPlan(step=step, decode_rows=rows,
                                           decode_slots=list(range(free, free + len(rows))))).token_ids)
        free += len(rows)
    return [list(col) for col in zip(*out)]


def test_a_client_seed_beyond_int64_samples_like_its_low_bits(model):
    # the frontend passes any seed msgspec carries (up to 2**64 - 1); the noise hashes its low 31 bits
    big, low = 2**64 - 1, 2**31 - 1
    tokens = sampled_tokens(model, [big, low], [5, 17, 99, 3], steps=6)
    assert tokens[0] == tokens[1]
    assert tokens[0] != sampled_tokens(model, [12345], [5, 17, 99, 3], steps=6)[0]


class EagerDecodeGraphs:
    """DecodeGraphs' contract on CPU, without the capture: a decode-only step's logits and their
    argmax, which it records as each row's last token, as the graph does on a GPU."""

    def __init__(self, runner):
        self.runner = runner

    def fits(self, n: int, longest: int) -> bool:
        return n > 0

    def run(self, rows, positions, slots, lens):
        from llaunch.runtime.models.batch import ForwardBatch

        r = self.runner
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        r.kv.req_to_slots[t(rows), t(positions)] = t(slots).to(r.kv.req_to_slots.dtype)
        empty = t([])
        batch = ForwardBatch(r.last_token[t(rows)], t(positions), t(slots), t(rows), t(lens), empty, empty, empty,
                             empty, t(list(range(len(rows)))), len(rows), 0, max_decode_len=MAX_LEN, every_token=True)
        logits = r.model.forward(batch, r.kv)
        tokens = torch.argmax(logits, dim=-1)
        r.last_token[t(rows)] = tokens
        return logits, tokens


@pytest.mark.parametrize("params", [
    dict(temperature=0.0),  # greedy: the graph's argmax is the token
    dict(temperature=0.0, logprobs=True, top_logprobs=2),  # greedy, with logprobs of the graph's logits
    dict(temperature=1.0, seed=7),  # sampled: the runner samples and overwrites the graph's token
    dict(temperature=0.0, presence_penalty=1.5, repetition_penalty=1.3),  # greedy, but through the penalties
], ids=["greedy", "greedy with logprobs", "seeded temperature", "penalized greedy"])
def test_decode_graph_tokens_are_used_only_for_plain_greedy_rows(model, params):
    """With the decode graph's argmax at hand the runner gives the same tokens as without it, for
    greedy, sampled and penalized rows alike."""
    prompt = [5, 17, 99, 3, 41]

    def generate(with_graph: bool) -> list[list[int]]:
        runner = ModelRunner(model, model.make_kv_cache(SLOTS + 1, ROWS + 1, MAX_LEN), ROWS, torch.device("cpu"))
        if with_graph:
            runner.graphs = EagerDecodeGraphs(runner)
        new = [NewSeq(row=r, request_id=str(r), sampling=SamplingParams(max_new_tokens=8, **params), prompt_ids=prompt)
               for r in range(ROWS)]
        n = len(prompt)
        chunks = [PrefillChunk(row=r, token_ids=prompt, start=0, slots=list(range(r * n, r * n + n)), sample=True)
                  for r in range(ROWS)]
        results = [runner.execute(StepPlan(step=0, new=new, prefill=chunks))]
        free = ROWS * n
        for step in range(1, 8):
            results.append(runner.execute(StepPlan(step=step, decode_rows=list(range(ROWS)),
                                                   decode_slots=list(range(free, free + ROWS)))))
            free += ROWS
        return [(r.token_ids, r.logprobs, r.top_ids) for r in results]

    assert generate(with_graph=True) == generate(with_graph=False)
