"""scripts/gated_quant_pipelined.py, the persistent gated quantize scripts/bench_gated_quant.py times against the
served kernel: the same e4m3 bytes and scales as kernels/fp8_gated_quant.py's for every row, whichever program
walks to it (fewer programs than rows), with a row's columns as up to three blocks."""
import sys
from pathlib import Path

import pytest
import torch

from conftest import INTERPRETED
from llaunch.kernels.fp8_gated_quant import gated_quantize
from llaunch.kernels.gated_activation import GELU_TANH, SILU
from test_kernel_fp8_gated_quant import sums

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))  # the script imports as `python scripts/...`
from gated_quant_pipelined import exact_blocks, gated_quantize_pipelined, stage_bytes  # noqa: E402


def test_a_row_as_up_to_three_blocks_that_hold_it():
    assert exact_blocks(18944) == (16384, 2048, 512)  # Qwen2-7B: exactly
    assert exact_blocks(1100) == (1024, 64, 16)  # 1,100 = 1,024 + 64 + 12: the last rounded up
    assert exact_blocks(64) == (64, 0, 0)
    assert stage_bytes(18944, 2, scaled=True) <= 227 * 1024 < stage_bytes(18944 + 1024, 2, scaled=True)


def test_rows_without_columns_launch_nothing():
    q, s = gated_quantize_pipelined(torch.zeros(3, 0, dtype=torch.bfloat16), torch.bfloat16)
    assert q.shape == (3, 0) and s.shape == (3, 1)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter test (on a GPU: scripts/bench_gated_quant.py)")
@pytest.mark.parametrize("m,inner,programs", [(7, 1100, 3), (5, 40, 2), (3, 64, 8), (4, 13, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaled", [True, False])
@pytest.mark.parametrize("act", [SILU, GELU_TANH])
def test_the_served_kernels_bytes_from_any_program(m, inner, programs, dtype, scaled, act):
    y, rows, channels = sums(m, inner, seed=m)
    if not scaled:
        y, rows, channels = (y.float() / 200).to(torch.bfloat16), None, None
    q, s = gated_quantize_pipelined(y, dtype, rows, channels, act, programs=programs)
    want_q, want_s = gated_quantize(y, dtype, rows, channels, act=act)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
