"""llaunch's Gemma 3 and Phi-3 paths on the GPU against transformers, at Gemma 3 12B's and Phi-4's shapes (4 of their
layers, random weights, the same tensors in both): llaunch in bf16 with the Triton kernels against transformers'
Gemma3ForCausalLM / Phi3ForCausalLM in float32 on those weights, as the reference. A 1,536-token prefill, then 16
teacher-forced decode steps.

- gemma3-12b: layers local, local, global, local (Gemma 3's 1,024-token window: the prefill and every decode step
  outgrow it), head size 256, q/k norms, (1 + w) norms drawn around w = 0, GeGLU, the global layer's linear rope x 8
  and the local base 10,000, query_pre_attn_scalar 256; and with Gemma 2's soft-caps switched on (attention 50,
  logits 30: the kernels' soft-capping at head size 256).
- phi4: fused qkv_proj / gate_up_proj, 40 heads over 10 KV heads; and Phi-4-mini's rotary (LongRoPE over 0.75 of
  each head, short factors: the whole sequence fits original_max_position_embeddings) with a 512-token window in
  every layer."""
from __future__ import annotations

import pytest
import torch

from gpu.conftest import profile_shape
from gpu.support import StateDictSource, batch_of, cosine_rows

LAYERS, PROMPT, STEPS = 4, 1536, 16
# llaunch's bf16 rows against float32: at least COSINE_MIN, unless transformers' own bf16 model falls below it at the
# shape (bf16 rounding of the reference itself); then no more than BF16_SPREAD below transformers' bf16.
COSINE_MIN, BF16_SPREAD = 0.999, 1e-4


def gemma3(softcaps: bool) -> tuple[str, dict]:
    s = profile_shape("gemma3-12b") | {"num_hidden_layers": LAYERS}
    s.pop("model_type")
    s.update(head_dim=256, sliding_window=1024, query_pre_attn_scalar=256,
             layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                 "rope_theta": s.pop("rope_theta")},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    if softcaps:
        s.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    return "gemma3", s


def phi4(mini_rotary: bool) -> tuple[str, dict]:
    s = profile_shape("phi4") | {"num_hidden_layers": LAYERS}
    s.pop("model_type")
    s.pop("head_dim")  # Phi3Config derives it: 5120 / 40
    s["rope_parameters"] = {"rope_type": "default", "rope_theta": s.pop("rope_theta")}
    if mini_rotary:  # Phi-4-mini: LongRoPE over 96 of each head's 128 dims, trained on 4,096 positions
        s.update(sliding_window=512, max_position_embeddings=16384, original_max_position_embeddings=4096)
        s["rope_parameters"] |= {"rope_type": "longrope", "partial_rotary_factor": 0.75,
                                 "short_factor": [1.0 + 0.02 * i for i in range(48)],
                                 "long_factor": [1.0 + 0.5 * i for i in range(48)]}
    return "phi3", s


CASES = {"gemma3-12b": lambda: gemma3(False), "gemma3-12b-softcaps": lambda: gemma3(True),
         "phi4": lambda: phi4(False), "phi4-mini-rotary-window": lambda: phi4(True)}


def compare(family: str, s: dict, device: str = "cuda", dtype=torch.bfloat16, prompt: int = PROMPT,
            steps: int = STEPS) -> dict:
    """transformers' float32 logits of prompt + steps tokens, and llaunch's (in `dtype`) for the prompt's prefill and
    `steps` teacher-forced decode steps, on the same random weights."""
    import transformers

    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.decoder import DecoderLM
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.weights import load_from

    torch.manual_seed(0)
    config_cls, model_cls = {"gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
                             "phi3": ("Phi3Config", "Phi3ForCausalLM")}[family]
    config = getattr(transformers, config_cls)(**s)
    config._attn_implementation = "eager"
    with torch.device(device):
        hf = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # transformers initialises norms to their identity: random ones make them count
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((0 if family == "gemma3" else 1) + 0.1 * torch.randn_like(p))
    arch = ModelArch.from_hf_config(config.to_dict())
    assert arch.gemma or arch.fused_projections
    ours = DecoderLM(arch, TpGroup(0, 1, None), torch.device(device), dtype, 4096).eval()
    load_from(ours, StateDictSource({k: v.to(dtype) for k, v in hf.state_dict().items()}))
    total = prompt + steps
    ids = torch.randint(0, min(100000, arch.vocab_size), (total,), generator=torch.Generator().manual_seed(1)).tolist()
    kv = ours.make_kv_cache(4096, 2, 4096)
    slots = torch.randperm(4000, generator=torch.Generator().manual_seed(2))[:total].tolist()
    kv.req_to_slots[0, :total] = torch.tensor(slots, dtype=torch.int32, device=device)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids], device=device)).logits[0].float()
        ref_bf16 = hf.to(torch.bfloat16)(torch.tensor([ids], device=device)).logits[0].float()
        prefill = ours.forward(batch_of(ids[:prompt], list(range(prompt)), slots[:prompt], [], [], prefill=0,
                                        device=device), kv)
        decode = torch.stack([ours.forward(batch_of([ids[i]], [i], [slots[i]], [0], [i + 1], device=device), kv)[0]
                              for i in range(prompt, total)])
    return dict(ref=ref[:prompt], ref_decode=ref[prompt:], prefill=prefill, decode=decode,
                hf_bf16=cosine_rows(ref_bf16[:prompt], ref[:prompt]).min().item(),
                hf_bf16_decode=cosine_rows(ref_bf16[prompt:], ref[prompt:]).min().item())


@pytest.fixture(scope="module", params=list(CASES))
def run(request):
    family, s = CASES[request.param]()
    assert s["num_hidden_layers"] == LAYERS
    return compare(family, s)


def bar(hf_bf16: float) -> float:
    return min(COSINE_MIN, hf_bf16 - BF16_SPREAD)


def test_prefill_logits_match_transformers_float32(run):
    cos = cosine_rows(run["prefill"], run["ref"])
    print(f"prefill cosine min {cos.min().item():.5f} mean {cos.mean().item():.5f}; "
          f"transformers bf16 min {run['hf_bf16']:.5f}")
    assert cos.min().item() >= bar(run["hf_bf16"])


def test_decode_logits_match_transformers_float32(run):
    cos = cosine_rows(run["decode"], run["ref_decode"])
    print(f"decode cosine min {cos.min().item():.5f} mean {cos.mean().item():.5f}; "
          f"transformers bf16 min {run['hf_bf16_decode']:.5f}")
    assert cos.min().item() >= bar(run["hf_bf16_decode"])
