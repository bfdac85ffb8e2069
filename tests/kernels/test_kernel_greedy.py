"""The decode graph's greedy tokens (kernels/greedy.py) against torch.argmax: the same token per row,
ties to the lowest index across and within pieces, and each row's last token written through `rows`."""
import pytest
import torch

from llaunch.kernels import dispatch as ops
from llaunch.kernels import greedy, reference


def _logits_with_ties(batch: int, vocab: int, device="cpu") -> torch.Tensor:
    """Random rows with awkward maxima: row 0's max appears in two pieces (the first must win), row
    1's twice inside one piece, row 2 is all -inf, row 3's max is the very last logit."""
    logits = torch.randn(batch, vocab, device=device).round(decimals=1)  # many equal values
    block = greedy.BLOCK
    if batch > 0 and vocab > block + 3:
        logits[0, [block + 3, 3]] = 9.0
    if batch > 1 and vocab > 40:
        logits[1, [40, 17]] = 8.5
    if batch > 2:
        logits[2] = float("-inf")
    if batch > 3:
        logits[3, -1] = 12.0
    return logits


def _check(run, logits):
    batch = logits.shape[0]
    rows = torch.randperm(batch + 3, device=logits.device)[:batch]  # rows of last_token in any order
    last = torch.full((batch + 3,), -1, dtype=torch.int64, device=logits.device)
    expected_last = last.clone()
    tokens = run(logits, rows, last)
    expected = reference.greedy_tokens(logits, rows, expected_last)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, expected)
    assert torch.equal(last, expected_last)  # written through rows, nothing else touched


@pytest.mark.parametrize("batch, vocab", [(1, 1), (4, 5000), (5, 2048), (3, 4097)])
def test_greedy_tokens_interpreted(ops, poisoned, batch, vocab):
    logits = _logits_with_ties(batch, vocab)
    with poisoned():
        _check(ops.greedy_tokens, logits)
    none = torch.zeros(0, dtype=torch.int64)
    assert ops.greedy_tokens(logits[:0], none, torch.zeros(1, dtype=torch.int64)).numel() == 0


def test_a_nan_ranks_above_every_number(ops):
    logits = torch.randn(1, 3000)
    logits[0, 2500] = float("nan")
    row = torch.zeros(1, dtype=torch.int64)
    assert ops.greedy_tokens(logits, row, torch.zeros(1, dtype=torch.int64)).item() == 2500


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_greedy_tokens_gpu(cuda, poisoned, batch):
    """Qwen2's vocabulary at the decode graphs' batch sizes."""
    logits = _logits_with_ties(batch, 152064, device=cuda)
    with poisoned():
        _check(ops.greedy_tokens, logits)
