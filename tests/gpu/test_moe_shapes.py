"""llaunch's MoE blocks on the GPU against transformers', at the shapes of Qwen3-30B-A3B (128 experts, top-8),
Qwen1.5-MoE (60 experts, top-4, a shared expert; here with a dense layer among them) and Mixtral-8x7B (8 experts of
14336, top-2), a few layers with random weights (the same tensors in both). transformers runs a 512-token prompt in
float32; each MoE layer's input there is fed to llaunch's block of that layer in bf16 through the Triton kernels
(routing, the fused experts), in slices of 1, 16 and the rest of the rows (decode-sized and prefill-sized launches).
(A tp rank's expert widths: tests/kernels/test_kernel_fused_moe.py.)

Layer by layer, because a whole model cannot be compared row by row: bf16 moves a router logit by ~0.4%, so where
two experts nearly tie for a token's k-th place llaunch may take the other one, and through attention every later
position of every later layer then differs from transformers' (on the H200 a whole Mixtral of two layers gave a
row routed alike everywhere a cosine of 0.995, and "ties" of 1.4 in the second layer). With the same input: at
least ROUTED_ALIKE_MIN of each layer's rows route as transformers does, those rows' outputs reach cosine
COSINE_MIN, and every expert chosen differently was within ROUTER_TIE of transformers' k-th logit (a tie, ~10x a
logit's bf16 rounding here, not a wrong routing)."""
from __future__ import annotations

import pytest
import torch

from gpu.support import StateDictSource, cosine_rows

PROMPT = 512
SLICES = [(0, 1), (1, 17), (17, PROMPT)]  # one decode row, a 16-row decode batch, a prefill
COSINE_MIN, ROUTED_ALIKE_MIN, ROUTER_TIE = 0.999, 0.8, 0.05
QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                     max_position_embeddings=4096, rms_norm_eps=1e-6, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, norm_topk_prob=True)
QWEN15_MOE = dict(model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=16, vocab_size=151936, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                  shared_expert_intermediate_size=5632, norm_topk_prob=False, mlp_only_layers=[2])
MIXTRAL_8X7B = dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                    max_position_embeddings=4096, rms_norm_eps=1e-5, num_local_experts=8, num_experts_per_tok=2)
CLASSES = {"qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral"}


def routed(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    return torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1).indices.sort(dim=-1).values


def run_layers(shape: dict, device: str, dtype: torch.dtype) -> dict:
    """Per MoE layer: transformers' router logits and block output (float32) and llaunch's (in `dtype`) for the
    block input transformers computed."""
    import transformers

    from llaunch.runtime.models.arch import ModelArch
    from llaunch.runtime.models.decoder import DecoderLM
    from llaunch.runtime.models.layers import TpGroup
    from llaunch.runtime.models.weights import load_from

    torch.manual_seed(0)
    name = CLASSES[shape["model_type"]]
    config = getattr(transformers, f"{name}Config")(**{k: v for k, v in shape.items() if k != "model_type"})
    with torch.device(device):
        hf = getattr(transformers, f"{name}ForCausalLM")(config).float().eval()
    with torch.no_grad():  # transformers initialises norms to 1: random ones exercise q_norm / k_norm
        for pname, p in hf.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    arch = ModelArch.from_hf_config(config.to_dict())
    assert arch.num_experts and arch.num_moe_layers == sum(1 for layer in hf.model.layers
                                                         if hasattr(layer.mlp, "experts"))
    ours = DecoderLM(arch, TpGroup(0, 1, None), torch.device(device), dtype, 4096).eval()
    load_from(ours, StateDictSource({k: v.to(dtype) for k, v in hf.state_dict().items()}))
    blocks = {}  # layer -> (input, output) of transformers' block
    for i, layer in enumerate(hf.model.layers):
        if arch.is_moe_layer(i):
            layer.mlp.register_forward_hook(lambda m, args, out, i=i: blocks.__setitem__(
                i, (args[0].reshape(-1, arch.hidden_size), (out[0] if isinstance(out, tuple) else out)
                    .reshape(-1, arch.hidden_size))))
    ids = torch.randint(0, arch.vocab_size - 100, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    layers = {}
    with torch.inference_mode():
        hf(ids.to(device))
        for i, (x, out) in blocks.items():
            mine, theirs = ours.layers[i].mlp, hf.model.layers[i].mlp
            xb = x.to(dtype)
            layers[i] = dict(
                ref=out.float(), router_ref=torch.nn.functional.linear(x, theirs.gate.weight).float(),
                ours=torch.cat([mine(xb[a:b]) for a, b in SLICES]).float(), router_ours=mine.gate(xb).float())
    return dict(layers=layers, top_k=arch.num_experts_per_tok)


def check(run) -> None:
    top_k, failures = run["top_k"], []
    for layer, got in run["layers"].items():
        theirs, mine = got["router_ref"], got["router_ours"]
        theirs_ids, mine_ids = routed(theirs, top_k), routed(mine, top_k)
        alike = (theirs_ids == mine_ids).all(dim=-1)
        widest = 0.0
        for row in (~alike).nonzero().flatten().tolist():  # a differing choice must be a near tie in theirs:
            kth = theirs[row].topk(top_k).values[-1]  # transformers' k-th logit against those only llaunch chose
            extra = sorted(set(mine_ids[row].tolist()) - set(theirs_ids[row].tolist()))
            widest = max(widest, (kth - theirs[row, extra]).abs().max().item())
        cos = cosine_rows(got["ours"], got["ref"])
        print(f"layer {layer}: rows routed alike {alike.float().mean().item():.3f}, their cosine min "
              f"{cos[alike].min().item():.5f} mean {cos[alike].mean().item():.5f}; widest tie {widest:.4f}")
        if alike.float().mean().item() < ROUTED_ALIKE_MIN or cos[alike].min().item() < COSINE_MIN \
                or widest > ROUTER_TIE:
            failures.append(layer)
    assert not failures, f"layers {failures} differ beyond bf16 (printed above)"


@pytest.mark.parametrize("shape", [QWEN3_30B_A3B, QWEN15_MOE, MIXTRAL_8X7B], ids=["qwen3-30b-a3b", "qwen1.5-moe",
                                                                               "mixtral-8x7b"])
def test_moe_blocks_match_transformers_float32(shape):
    check(run_layers(shape, "cuda", torch.bfloat16))
