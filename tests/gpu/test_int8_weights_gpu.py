"""model.quantization=int8 on a GPU with real weights (SmolLM2 as the GPU suite carries it), served shape (one prefill,
then decode steps of all 16 chats' rows): its top-1 agreement with transformers float32 against llaunch bf16's, and
against the same int8 weights through the plain-torch ops (kernels.backend=reference: the CPU path, whose roundings
the GPU kernels keep up to the order of a sum). As test_smollm2_agreement does for bf16, agreement is judged where
float32's top two logits are clearly apart: near-ties are frequent in the cut SmolLM2 and any two bf16 paths flip
different ones (on an H100 the served int8 path and the plain-torch one parted on 4.9% of all 1,024 positions while
agreeing with float32 equally well, 92.0% and 91.8%)."""
from __future__ import annotations

import json

import pytest
import torch

from gpu.support import agreement
from gpu.test_smollm2_agreement import MARGIN, clear, float32_gaps, llaunch_argmax, model_dir, reference  # noqa: F401

pytestmark = pytest.mark.gpu


def test_int8_weights_on_smollm2_are_the_reference_roundings(model_dir, reference, float32_gaps,  # noqa: F811
                                                             kernel_settings, monkeypatch):
    from llaunch.kernels.settings import Backend
    from llaunch.runtime.models import weights
    from llaunch.runtime.models.int8_linear import Int8Layer, quantize_linears_int8

    prompts, conts, _, exact = reference
    cuda = torch.device("cuda", 0)
    bf16 = llaunch_argmax(model_dir, 0, 1, cuda, prompts, conts)
    layers = []
    load = weights.load_from

    def load_and_quantize(model, source, progress=None):  # llaunch_argmax loads through weights.load_from
        load(model, source, progress)
        quantize_linears_int8(model)
        layers.append(sum(isinstance(m, Int8Layer) for m in model.modules()))

    monkeypatch.setattr(weights, "load_from", load_and_quantize)
    served = llaunch_argmax(model_dir, 0, 1, cuda, prompts, conts)
    kernel_settings(backend=Backend.reference)
    plain = llaunch_argmax(model_dir, 0, 1, cuda, prompts, conts)
    monkeypatch.undo()
    assert len(layers) == 2 and layers[0] == layers[1] > 0
    figures = {"bf16": agreement(bf16, exact), "int8 GPU (served)": agreement(served, exact),
               "int8 plain-torch ops": agreement(plain, exact)}
    on_clear = {name: agreement(clear(x, float32_gaps), clear(exact, float32_gaps))
                for name, x in (("int8 GPU (served)", served), ("int8 plain-torch ops", plain))}
    print(json.dumps({"top-1 agreement with transformers float32": {k: round(v, 4) for k, v in figures.items()},
                      "on clear positions": {k: round(v, 4) for k, v in on_clear.items()},
                      "served vs plain-torch": {"all": round(agreement(served, plain), 4),
                                                "clear": round(agreement(clear(served, float32_gaps),
                                                                         clear(plain, float32_gaps)), 4)}}))
    # the kernels are the reference's roundings: where float32 does not nearly tie, no worse than the plain-torch ops
    assert on_clear["int8 GPU (served)"] >= on_clear["int8 plain-torch ops"] - MARGIN, on_clear
    # int8 rows cost SmolLM2 2.0 points of top-1 on CPU (all 30 blocks, bf16: scripts/fp8_accuracy.py's bf16_int8),
    # where e4m3 costs 8 (14 on this cut): a broken int8 layer costs far more than 5
    assert figures["int8 GPU (served)"] >= figures["bf16"] - 0.05, figures
