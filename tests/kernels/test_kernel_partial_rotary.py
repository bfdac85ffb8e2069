"""Partial rotary (Phi-3's partial_rotary_factor, Phi-4-mini's 0.75): tables of R/2 columns rotate each head's first
R dims. The reference against transformers' Phi-3 rotation; the rotary kernel on the leading-dims view the GPU path
passes it (kernels/dispatch.rotary_embedding) against the reference."""
import pytest
import torch

from llaunch.kernels import reference


def _case(dim=32, rot=24, tokens=11, q_heads=5, kv_heads=1, dtype=torch.float32):
    q = torch.randn(tokens, q_heads, dim).to(dtype)
    k = torch.randn(tokens, kv_heads, dim).to(dtype)
    positions = torch.randperm(64)[:tokens]
    cos, sin = reference.rope_cos_sin(rot, 64, 10000.0)
    return q, k, positions, cos, sin


def test_reference_is_transformers_phi3_partial_rotary():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    q, k, positions, cos, sin = _case()
    ours_q, ours_k = reference.rotary_embedding(q, k, positions, cos, sin)
    full = lambda t: torch.cat([t, t], -1)[positions]  # noqa: E731  transformers' [T, R] tables
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), full(cos), full(sin), unsqueeze_dim=0)
    assert torch.equal(ours_q, ref_q.transpose(0, 1)) and torch.equal(ours_k, ref_k.transpose(0, 1))
    assert torch.equal(ours_q[..., 24:], q[..., 24:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_on_the_leading_dims_equals_the_reference(ops, poisoned, close, dtype):
    q, k, positions, cos, sin = _case(dtype=dtype)
    with poisoned():
        q_rot, k_rot = ops.rotary_embedding(q[..., :24], k[..., :24], positions, cos, sin)
    ref_q, ref_k = reference.rotary_embedding(q, k, positions, cos, sin)
    close(q_rot, ref_q[..., :24].contiguous())
    close(k_rot, ref_k[..., :24].contiguous())
