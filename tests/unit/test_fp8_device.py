"""fp8 weights and an fp8 KV cache on a GPU before Ada stop the worker at start, with the reason."""
import torch

from llaunch.runtime.models.arch import ModelArch
from llaunch.runtime.models.decoder import DecoderLM
from llaunch.runtime.models.fp8_linear import quantize_linears
from llaunch.runtime.models.layers import TpGroup
from llaunch.runtime.worker.fp8_device import fp8_problem

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=128)


def tiny_model():
    return DecoderLM(ModelArch.from_hf_config(TINY), TpGroup(0, 1, None), torch.device("cpu"), torch.float32, 64)


def test_fp8_weights_or_kv_on_an_ampere_gpu_are_refused_with_the_way_out():
    model = tiny_model()
    assert fp8_problem(model, fp8_kv=False, capability=(8, 0)) is None  # nothing fp8: any GPU
    kv = fp8_problem(model, fp8_kv=True, capability=(8, 0), name="NVIDIA A100-SXM4-80GB")
    assert "cache.kv_dtype=fp8_e4m3" in kv and "8.9" in kv and "A100" in kv and "8.0" in kv
    quantize_linears(model)
    weights = fp8_problem(model, fp8_kv=False, capability=(8, 6))
    assert "model.quantization=fp8" in weights and "kv_dtype" not in weights.split(" need ")[0]
    both = fp8_problem(model, fp8_kv=True, capability=(7, 5))
    assert "fp8 weights" in both and "fp8 KV cache" in both


def test_ada_and_hopper_run_them():
    model = tiny_model()
    quantize_linears(model)
    for capability in ((8, 9), (9, 0), (10, 0)):
        assert fp8_problem(model, fp8_kv=True, capability=capability) is None
