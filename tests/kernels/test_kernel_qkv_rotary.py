"""The one-row qkv projection with rotary + KV store fused, against linear → rotary_store_kv."""
import pytest
import torch

from llaunch import kernels
from llaunch.kernels import reference


def _case(k, q_heads, kv_heads, dim, dtype, bias, device="cpu", slots_total=37):
    n = (q_heads + 2 * kv_heads) * dim
    x = torch.randn(1, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    cos, sin = reference.rope_cos_sin(dim, 4096, 1e6, device=device)
    cos, sin = cos.to(dtype), sin.to(dtype)  # the model rounds its tables to its dtype
    positions = torch.tensor([3001], device=device)
    slots = torch.tensor([29], device=device)
    caches = [torch.randn(slots_total, kv_heads, dim, device=device).to(dtype) for _ in range(4)]
    return x, w, b, positions, cos, sin, slots, caches


def _reference(x, w, b, q_heads, kv_heads, dim, positions, cos, sin, k_cache, v_cache, slots):
    q, k, v = reference.linear(x, w, b).split([q_heads * dim, kv_heads * dim, kv_heads * dim], -1)
    return reference.rotary_store_kv(q.view(1, q_heads, dim), k.view(1, kv_heads, dim), v.view(1, kv_heads, dim),
                                     positions, cos, sin, k_cache, v_cache, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k, heads, dim, bias", [(40, (7, 1), 16, True), (300, (3, 1), 64, False),
                                                 (96, (2, 2), 8, True)])
def test_qkv_rotary_interpreted(ops, poisoned, close, dtype, k, heads, dim, bias):
    x, w, b, positions, cos, sin, slots, (kc, vc, ref_kc, ref_vc) = _case(k, *heads, dim, dtype, bias)
    ref_kc.copy_(kc), ref_vc.copy_(vc)
    with poisoned():
        q = ops.qkv_rotary_store_kv(x, w, b, *heads, positions, cos, sin, kc, vc, slots)
    close(q, _reference(x, w, b, *heads, dim, positions, cos, sin, ref_kc, ref_vc, slots))
    close(kc, ref_kc)  # the slot's row matches; every other row is untouched
    close(vc, ref_vc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qkv_rotary_interpreted_equals_the_two_kernels_bit_for_bit(ops, dtype):
    """Same K tiles, same rounding points: under the interpreter the fused kernel and gemv →
    rotary_store_kv agree exactly (on an H200 they do not yet: docs/benchmarks.md)."""
    x, w, b, positions, cos, sin, slots, (kc, vc, two_kc, two_vc) = _case(300, 3, 1, 64, dtype, True)
    two_kc.copy_(kc), two_vc.copy_(vc)
    q = ops.qkv_rotary_store_kv(x, w, b, 3, 1, positions, cos, sin, kc, vc, slots)
    qr, kr, vr = ops.gemv(x, w, b).split([3 * 64, 64, 64], -1)
    q_two = ops.rotary_store_kv(qr.view(1, 3, 64), kr.view(1, 1, 64), vr.view(1, 1, 64), positions, cos, sin,
                                two_kc, two_vc, slots)
    assert torch.equal(q, q_two) and torch.equal(kc, two_kc) and torch.equal(vc, two_vc)


def test_qkv_rotary_refuses_a_weight_that_is_not_whole_heads(ops):
    x, w, b, positions, cos, sin, slots, (kc, vc, _, _) = _case(40, 7, 1, 16, torch.float32, False)
    with pytest.raises(ValueError, match=r"\(6 \+ 2·1\) heads × 16"):
        ops.qkv_rotary_store_kv(x, w, b, 6, 1, positions, cos, sin, kc, vc, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("k, heads, dim, bias", [(3584, (28, 4), 128, True), (576, (9, 3), 64, False)])
def test_qkv_rotary_gpu(cuda, close, k, heads, dim, bias):
    """Qwen2-7B and SmolLM2 shapes in bf16 against the torch reference, and against the two kernels it
    replaces (gemv → rotary_store_kv), within the bf16 tolerance; prints how many elements differ
    from the two kernels in q, k and v (v is not rotated: it tells the sum from the epilogue)."""
    x, w, b, positions, cos, sin, slots, (kc, vc, ref_kc, ref_vc) = _case(k, *heads, dim, torch.bfloat16, bias,
                                                                         device=cuda, slots_total=64)
    two_kc, two_vc = kc.clone(), vc.clone()
    ref_kc.copy_(kc), ref_vc.copy_(vc)
    ops = kernels.dispatch.triton_ops()
    q = ops.qkv_rotary_store_kv(x, w, b, *heads, positions, cos, sin, kc, vc, slots)
    close(q, _reference(x, w, b, *heads, dim, positions, cos, sin, ref_kc, ref_vc, slots))
    close(kc, ref_kc)
    close(vc, ref_vc)
    qkv = ops.gemv(x, w, b)
    q_ref, k_ref, v_ref = qkv.split([heads[0] * dim, heads[1] * dim, heads[1] * dim], -1)
    q_two = ops.rotary_store_kv(q_ref.view(1, heads[0], dim), k_ref.view(1, heads[1], dim),
                                v_ref.view(1, heads[1], dim), positions, cos, sin, two_kc, two_vc, slots)
    close(q, q_two)
    close(kc, two_kc)
    close(vc, two_vc)
    row = slots.item()
    for name, a, b in (("q", q, q_two), ("k", kc[row], two_kc[row]), ("v", vc[row], two_vc[row])):
        print(f"fused vs two kernels, {name}: {(a != b).sum().item()} of {a.numel()} differ, "
              f"max {(a.float() - b.float()).abs().max().item():.3g}")
