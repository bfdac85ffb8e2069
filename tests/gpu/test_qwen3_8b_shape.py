"""llaunch's Qwen3 path on the GPU against transformers, at Qwen3-8B's shape (4 of its 36 layers, random
weights, the same tensors in both): llaunch in bf16 with the Triton kernels (q/k norms per head, rotary,
attention over the KV cache) against transformers' Qwen3 in float32 on those weights, as the reference.
A 512-token prefill, then 16 teacher-forced decode steps; and the same with YaRN (factor 4 over 256
trained positions, so the prefill and every decode step run past original_max_position_embeddings)."""
from __future__ import annotations

import pytest
import torch

from gpu.conftest import profile_shape
from gpu.support import StateDictSource, batch_of, cosine_rows

LAYERS, PROMPT, STEPS = 4, 512, 16
COSINE_MIN = 0.999
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


def shape(rope_scaling):
    s = profile_shape("qwen3-8b") | {"num_hidden_layers": LAYERS}
    s["rope_parameters"] = {"rope_type": "default", "rope_theta": s.pop("rope_theta"), **(rope_scaling or {})}
    if rope_scaling:  # the stretched length (transformers warns when it is not original x factor)
        s["max_position_embeddings"] = 1024
    return s


@pytest.fixture(scope="module", params=[None, YARN], ids=["default-rope", "yarn"])
def run(request):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.decoder import DecoderLM
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.weights import load_from

    torch.manual_seed(0)
    s = shape(request.param)
    with torch.device("cuda"):
        hf = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in s.items() if k != "model_type"})).float().eval()
    with torch.no_grad():  # transformers initialises norms to 1: random ones exercise q_norm / k_norm
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    arch = ModelArch.from_hf_config(s)
    assert arch.qk_norm and (arch.rope_scaling or {}).get("rope_type") == (request.param or {}).get("rope_type")
    ours = DecoderLM(arch, TpGroup(0, 1, None), torch.device("cuda"), torch.bfloat16, 4096).eval()
    load_from(ours, StateDictSource({k: v.to(torch.bfloat16) for k, v in hf.state_dict().items()}))
    total = PROMPT + STEPS
    ids = torch.randint(0, 150000, (total,), generator=torch.Generator().manual_seed(1)).tolist()
    kv = ours.make_kv_cache(4096, 2, 4096)
    slots = torch.randperm(4000, generator=torch.Generator().manual_seed(2))[:total].tolist()
    kv.req_to_slots[0, :total] = torch.tensor(slots, dtype=torch.int32, device="cuda")
    with torch.inference_mode():
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float()
        prefill = ours.forward(batch_of(ids[:PROMPT], list(range(PROMPT)), slots[:PROMPT], [], [], prefill=0), kv)
        decode = torch.stack([ours.forward(batch_of([ids[i]], [i], [slots[i]], [0], [i + 1]), kv)[0]
                              for i in range(PROMPT, total)])
    return dict(ref=ref, prefill=prefill, decode=decode)


def test_prefill_logits_match_transformers_float32(run):
    cos = cosine_rows(run["prefill"], run["ref"][:PROMPT])
    print(f"prefill cosine min {cos.min().item():.5f} mean {cos.mean().item():.5f}")
    assert cos.min().item() >= COSINE_MIN


def test_decode_logits_match_transformers_float32(run):
    cos = cosine_rows(run["decode"], run["ref"][PROMPT:])
    print(f"decode cosine min {cos.min().item():.5f} mean {cos.mean().item():.5f}")
    assert cos.min().item() >= COSINE_MIN
