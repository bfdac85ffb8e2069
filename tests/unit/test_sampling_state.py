"""SamplingState.sample: greedy rows take the argmax and draw no noise over the vocabulary, alone or
beside sampled rows (the noise hash was ~13% of a CPU decode step); sampled rows draw what they draw
alone, whatever rows share their step."""
from __future__ import annotations

import pytest
import torch

from llaunch.kernels import reference
from llaunch.runtime.ipc.messages import SamplingParams
from llaunch.runtime.worker.sampling_state import SamplingState

VOCAB, ROWS = 301, 6


@pytest.fixture
def noise_rows(monkeypatch) -> list[int]:
    """How many rows each call of the reference sampler's noise hash covered."""
    calls: list[int] = []
    real = reference._uniform_noise

    def counted(seeds, offsets, vocab):
        calls.append(seeds.shape[0])
        return real(seeds, offsets, vocab)

    monkeypatch.setattr(reference, "_uniform_noise", counted)
    return calls


def state_with(params: list[SamplingParams]) -> SamplingState:
    state = SamplingState(ROWS, VOCAB, torch.device("cpu"))
    state.set_rows([(row, sp, [1, 2, 3]) for row, sp in enumerate(params)])
    return state


GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, seed=11)
TOP1 = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=1, seed=12)  # greedy too


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=8, temperature=0.9, top_p=0.95, seed=seed)


def test_a_greedy_batch_draws_no_noise(noise_rows):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    state = state_with([GREEDY, TOP1, GREEDY])
    for _ in range(3):
        assert state.sample(logits, [0, 1, 2]).tolist() == logits.argmax(-1).tolist()
    assert noise_rows == []


def test_greedy_rows_beside_sampled_rows_draw_no_noise_and_nothing_changes(noise_rows):
    torch.manual_seed(1)
    params = [GREEDY, sampled(5), TOP1, sampled(7), GREEDY]
    steps = [torch.randn(len(params), VOCAB) for _ in range(4)]
    mixed = state_with(params)
    alone = [state_with([sp]) for sp in params]  # each row in a batch of its own
    for logits in steps:
        tokens = mixed.sample(logits, list(range(len(params)))).tolist()
        assert noise_rows[-1] == 2  # only the two sampled rows hashed noise
        for i, sp in enumerate(params):
            if sp.greedy:
                assert tokens[i] == int(logits[i].argmax())
            else:
                assert tokens[i] == int(alone[i].sample(logits[i:i + 1], [0])[0])
