"""A decode graph's first kernel (kernels/decode_embed.py) against the torch ops it replaces: the
slot table gets each row's new slot, and the output is each row's last token's embedding."""
import pytest
import torch

from llaunch import kernels
from llaunch.kernels import reference


def _case(batch: int, hidden: int, dtype, device="cpu"):
    rows = torch.randperm(batch + 3, device=device)[:batch]  # rows in any order, some not in the step
    positions = torch.randint(0, 40, (batch,), device=device)
    slots = torch.randint(0, 1000, (batch,), device=device)
    req_to_slots = torch.full((batch + 3, 40), -1, dtype=torch.int32, device=device)
    last_token = torch.randint(0, 300, (batch + 3,), device=device)
    embed = torch.randn(300, hidden, device=device).to(dtype)
    return rows, positions, slots, req_to_slots, last_token, embed


def _check(run, case):
    rows, positions, slots, req_to_slots, last_token, embed = case
    expected_table = req_to_slots.clone()
    expected = reference.decode_embed(rows, positions, slots, expected_table, last_token, embed)
    got = run(rows, positions, slots, req_to_slots, last_token, embed)
    assert got.dtype == embed.dtype and torch.equal(got, expected)  # a copy: bit for bit
    assert torch.equal(req_to_slots, expected_table)  # each row's new slot, nothing else


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch, hidden", [(1, 64), (3, 1500), (6, 2048)])
def test_decode_embed_interpreted(ops, poisoned, dtype, batch, hidden):
    case = _case(batch, hidden, dtype)
    with poisoned():
        _check(ops.decode_embed, case)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_decode_embed_gpu(cuda, poisoned, batch):
    case = _case(batch, 3584, torch.bfloat16, device=cuda)
    with poisoned():
        _check(kernels.decode_embed, case)
