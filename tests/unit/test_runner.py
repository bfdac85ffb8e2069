"""The worker's model runner driven by hand-written plans on CPU (tiny random Qwen2, float32)."""
import pytest
import torch

from fixtures.tiny_models import model_config_from_folder, write_tiny_checkpoint
from llaunch.runtime.ipc.messages import NewSeq, PrefillChunk, SamplingParams, StepPlan
from llaunch.runtime.models import build_model
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
