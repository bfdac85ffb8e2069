"""Penalties and seeded sampling vs the references: same logits and seeds must give the same tokens."""
import pytest
import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import reference

# One row per sampling mode: greedy, temperature only, top-k, top-p, both, top-k >= vocab, top-p tiny.
TEMPERATURE = [0.0, 0.7, 1.0, 1.3, 0.5, 1.0, 2.0, -1.0]
TOP_P = [1.0, 1.0, 1.0, 0.5, 0.9, 1.0, 1e-4, 0.3]
TOP_K = [-1, 0, 50, -1, 5, 1 << 40, -1, 7]
SEEDS = [1, 2, 3, -5, (1 << 40) + 7, 123456789, 0, 42]


def _sampling_rows(device):
    return (torch.tensor(TEMPERATURE, device=device), torch.tensor(TOP_P, device=device),
            torch.tensor(TOP_K, device=device), torch.tensor(SEEDS, device=device))


def _check_same_tokens(draw, logits, steps, **hints):
    temperature, top_p, top_k, seeds = _sampling_rows(logits.device)
    drawn, expected = [], []
    for step in range(steps):
        offsets = torch.full_like(seeds, step * 7919)
        drawn.append(draw(logits, temperature, top_p, top_k, seeds, offsets, **hints))
        expected.append(reference.sample(logits, temperature, top_p, top_k, seeds, offsets))
    drawn, expected = torch.stack(drawn), torch.stack(expected)
    assert drawn.dtype == torch.int64
    assert torch.equal(drawn, expected)
    assert len(set(drawn[:, 1].tolist())) > steps // 2  # the noise really varies with the step


@pytest.mark.slow  # seconds: make test runs it, make test-fast does not
@pytest.mark.parametrize("vocab", [1000, 3001])
def test_sample_matches_reference_interpreted(ops, poisoned, vocab):
    logits = torch.randn(len(SEEDS), vocab)
    with poisoned():
        _check_same_tokens(ops.sample, logits, steps=12)


def test_sample_without_top_filters_interpreted(ops, poisoned):
    logits = 3 * torch.randn(len(SEEDS), 777)
    temperature, _, _, seeds = _sampling_rows("cpu")
    no_filter_p, no_filter_k = torch.ones_like(temperature), torch.full_like(seeds, -1)
    for step in range(6):
        offsets = torch.full_like(seeds, step)
        with poisoned():
            tokens = ops.sample(logits, temperature, no_filter_p, no_filter_k, seeds, offsets, top_filters=False)
        assert torch.equal(tokens, reference.sample(logits, temperature, no_filter_p, no_filter_k, seeds, offsets))


def test_greedy_rows_take_the_first_maximum(ops, poisoned):
    logits = torch.randn(3, 300)
    logits[:, 17] = logits[:, 200] = 50.0  # a tie: argmax picks the first index
    zeros = torch.zeros(3)
    with poisoned():
        tokens = ops.sample(logits, zeros, torch.ones(3), torch.zeros(3, dtype=torch.int64),
                            torch.arange(3), torch.zeros(3, dtype=torch.int64))
    assert tokens.tolist() == [17, 17, 17]


@pytest.mark.parametrize("counts_dtype", [torch.float32, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_penalties_interpreted(ops, poisoned, close, counts_dtype, dtype):
    batch, vocab = 5, 3001
    logits = (4 * torch.randn(batch, vocab)).to(dtype)
    counts = torch.randint(0, 4, (batch, vocab)).to(counts_dtype)
    seen = torch.rand(batch, vocab) < 0.3
    presence, frequency, repetition = torch.rand(batch), torch.rand(batch), 1 + torch.rand(batch)
    repetition[0] = 1.0
    with poisoned():
        out = ops.apply_penalties(logits, counts, presence, frequency, repetition, seen)
    close(out, reference.apply_penalties(logits, counts, presence, frequency, repetition, seen))


@pytest.mark.gpu
def test_sample_gpu(cuda, poisoned):
    logits = torch.randn(len(SEEDS), 152064, device=cuda)
    with poisoned():
        _check_same_tokens(ops.sample, logits, steps=8)


@pytest.mark.gpu
def test_sample_gpu_matches_cpu_draws(cuda):
    logits = 4 * torch.randn(len(SEEDS), 32000)
    temperature, top_p, top_k, seeds = _sampling_rows("cpu")
    offsets = torch.full_like(seeds, 3)
    on_gpu = ops.sample(logits.to(cuda), temperature.to(cuda), top_p.to(cuda), top_k.to(cuda),
                            seeds.to(cuda), offsets.to(cuda))
    assert torch.equal(on_gpu.cpu(), reference.sample(logits, temperature, top_p, top_k, seeds, offsets))


@pytest.mark.gpu
def test_penalties_gpu(cuda, poisoned, close):
    batch, vocab = 64, 152064
    logits = 4 * torch.randn(batch, vocab, device=cuda)
    counts = torch.randint(0, 4, (batch, vocab), device=cuda).float()
    seen = torch.rand(batch, vocab, device=cuda) < 0.3
    presence, frequency = torch.rand(batch, device=cuda), torch.rand(batch, device=cuda)
    repetition = 1 + torch.rand(batch, device=cuda)
    with poisoned():
        out = ops.apply_penalties(logits, counts, presence, frequency, repetition, seen)
    close(out, reference.apply_penalties(logits, counts, presence, frequency, repetition, seen))
