"""The fp8 KV cache on SmolLM2 (real weights, CPU, float32 model): teacher-forced over ~300 tokens of
text (prefill chunks that read earlier chunks' fp8 KV, then decode steps), the top-1 token agrees with
the float32 KV cache's at ≥ 97% of positions (issue #23), and so do the positions past the first chunk,
the ones that read fp8 K/V (measured: 99.7% both; 1 position of 305 flips). The calibration records
each layer's K/V absmax and the scales file it writes loads back; the KV takes 1 byte per element.

Why the chunk being prefilled attends its own K/V unrounded (kernels/dispatch.py's prefill_attention;
SGLang's extend attention does the same) and only its prefix through fp8: with every read rounded,
agreement was 94.4% (scales 1.0); K alone rounded 96.7%, V alone 97.7%; per-layer absmax scales 94.1%,
per-(layer, kv-head) 94.8%, per-channel K 93.8%, even a dynamic scale per token and head 94.8%.
Scaling does not pay: e4m3's relative rounding error is the same in every normal binade (at scale 1.0
~1% of K falls below 2^-6), the loss is its 3 mantissa bits on the nearby tokens (the flips were
near-ties: top-1 vs top-2 logit gap 0.02-0.35, median 0.78); the second chunk, reading 160 fp8 prefix
tokens, flipped 8 positions fully rounded and 1 with its own K/V unrounded. Decode steps read all fp8.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fixtures.forward_batches import SlotTables
from fixtures.tiny_models import model_config_from_folder, smollm2_dir
from llaunch.kernels.fp8 import FP8
from llaunch.runtime.config import CacheConfig, KvDType
from llaunch.runtime.models.kv_fp8 import use_fp8_kv
from llaunch.runtime.models.loader import build_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TEXT = (
    "The lighthouse keeper had kept the same routine for thirty years. Every evening, an hour before sunset, he "
    "climbed the one hundred and twelve steps of the tower, cleaned the great lens with a soft cloth, checked "
    "the oil in the reservoir, and wound the clockwork that turned the light. The village below depended on him, "
    "though few of its people ever thought about it. Fishing boats came home in the dark guided by the slow sweep "
    "of the beam, and the ferry captain set his course by it on winter nights when the fog rolled in from the "
    "open sea. One autumn a letter arrived from the harbour authority in the city. The lighthouse was to be "
    "automated. An electric lamp and a small computer would replace the clockwork, the oil and the keeper. He "
    "read the letter twice, folded it carefully, and put it in the drawer of his desk beside his logbooks. For "
    "weeks he said nothing to anyone. Then, on the first clear night of November, he invited the children of the "
    "village to climb the tower with him. He showed them how the lens gathered the light, how the clockwork "
    "kept time, and how to read the weather from the colour of the sky at dusk. Years later, when the old tower "
    "had become a museum, one of those children, now a teacher herself, brought her own class to see it. She "
    "told them about the keeper and the night he had shown them the light, and she explained that the most "
    "important machines are often the ones nobody notices until they are gone."
)
CHUNK, DECODED = 160, 8
FLOOR = 0.97  # issue #23; measured 0.9967 (see above); a scale or dequantization bug falls far below


def teacher_forced_top1(model, ids: list[int]) -> torch.Tensor:
    """Top-1 prediction after every token: prefill chunks, then the last DECODED tokens one step each."""
    tables = SlotTables(model, max_rows=1, max_len=512, num_slots=512)
    prefill, tops = ids[:-DECODED], []
    for start in range(0, len(prefill), CHUNK):
        batch = tables.batch(prefill=[(0, prefill[start:start + CHUNK])], all_logits=True)
        tops.append(model.forward(batch, tables.kv).argmax(-1))
    for token in ids[-DECODED:]:
        tops.append(model.forward(tables.batch(decode=[(0, token)]), tables.kv).argmax(-1))
    return torch.cat(tops)


@pytest.fixture(scope="module")
def smollm2():
    if not (smollm2_dir() / "config.json").is_file():
        pytest.skip("SmolLM2 not converted (make setup)")
    from transformers import AutoTokenizer

    cfg = model_config_from_folder(smollm2_dir())
    ids = AutoTokenizer.from_pretrained(smollm2_dir())(TEXT)["input_ids"]
    model = build_model(cfg, device=torch.device("cpu"), dtype=torch.float32)
    return model, ids, teacher_forced_top1(model, ids)


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


def test_fp8_kv_top1_agrees_with_float_kv(smollm2, tmp_path):
    model, ids, reference = smollm2
    assert len(ids) >= 250
    float_bytes = model.kv_bytes_per_token
    calibration = use_fp8_kv(model, CacheConfig(kv_dtype=KvDType.fp8_e4m3, kv_calibration=str(tmp_path / "kv.json")),
                             run_id="test")
    try:
        assert model.kv_bytes_per_token * 4 == float_bytes  # float32 → 1 byte (bf16 → fp8: 2×)
        assert model.make_kv_cache(4, 1, 8).k[0].dtype == FP8
        default = teacher_forced_top1(model, ids)
        calibration.write()
        scales = json.loads((tmp_path / "kv.json").read_text())
        layer0_k = model.layers[0].self_attn.kv_scales.k_amax.item()
        assert len(scales["k_scale"]) == model.arch.num_hidden_layers and scales["k_absmax"][0] == layer0_k > 0
        assert scales["k_scale"][0] == pytest.approx(layer0_k / 448)
        use_fp8_kv(model, CacheConfig(kv_dtype=KvDType.fp8_e4m3, kv_scales=str(tmp_path / "kv.json")))
        loaded = [(a.kv_scales.k.item(), a.kv_scales.v.item()) for a in (layer.self_attn for layer in model.layers)]
        assert loaded == [pytest.approx((k, v)) for k, v in zip(scales["k_scale"], scales["v_scale"])]
    finally:
        model.kv_dtype = model.dtype
        for layer in model.layers:
            layer.self_attn.kv_scales = None
    past_first_chunk = agreement(default[CHUNK:], reference[CHUNK:])  # the positions that read fp8 K/V
    print(f"fp8 KV top-1 agreement over {len(ids)} tokens: {agreement(default, reference):.4f}, "
          f"past the first chunk: {past_first_chunk:.4f}")
    assert FLOOR <= agreement(default, reference) < 1
    assert past_first_chunk >= FLOOR


def test_the_store_rounds_to_nearest_even_saturates_and_reads_back_at_the_same_scale():
    from llaunch.kernels.kv_fp8 import Dequantizing, KvScales, store_kv

    scale = torch.tensor(0.5)  # stored = x / scale, read = stored * scale
    x = torch.tensor([1.0625, 1.1875, 1.5 * 2.0**-9, 1000.0, -1000.0]) * scale  # two ties, a subnormal tie, overflow
    k = x.view(-1, 1, 1)
    k_cache, v_cache = torch.zeros(5, 1, 1, dtype=FP8), torch.zeros(5, 1, 1, dtype=FP8)
    store_kv(k_cache, v_cache, torch.arange(5), k, -k, KvScales(scale, scale))
    read = Dequantizing(k_cache, scale, torch.float32)[torch.arange(5)].view(-1) / scale
    assert read.tolist() == [1.0, 1.25, 2 * 2.0**-9, 448.0, -448.0]
    assert (Dequantizing(v_cache, scale, torch.float32)[torch.arange(5)].view(-1) / scale).tolist() == \
        [-1.0, -1.25, -2 * 2.0**-9, -448.0, 448.0]


def test_a_scales_file_must_give_every_layer(tmp_path):
    from llaunch.runtime.models.kv_fp8 import read_scales

    (tmp_path / "s.json").write_text(json.dumps({"k_scale": [1.0, 2.0], "v_scale": [1.0]}))
    with pytest.raises(ValueError, match="v_scale must list 2 scales"):
        read_scales(str(tmp_path / "s.json"), 2)
    (tmp_path / "s.json").write_text(json.dumps({"k_scale": [1.0, -2.0], "v_scale": [1.0, 1.0]}))
    with pytest.raises(ValueError, match="not a positive number"):
        read_scales(str(tmp_path / "s.json"), 2)
    assert replace(CacheConfig(), kv_dtype=KvDType.fp8_e4m3).kv_scales is None


def test_the_periodic_calibration_write_waits_for_every_layer(tmp_path):
    """The write thread reads the layers' absmax while a forward updates them one by one: a first forward half
    way through must not reach the file as layers that saw nothing (scale 1.0, the race a served test met); the
    write at exit takes what there is."""
    from llaunch.kernels.kv_fp8 import KvScales
    from llaunch.runtime.models.kv_fp8 import KvCalibration

    def layer(k_amax: float, v_amax: float) -> KvScales:
        one = torch.tensor(1.0)
        return KvScales(one, one, torch.tensor(k_amax), torch.tensor(v_amax))

    path = tmp_path / "kv.json"
    layers = [layer(3.5, 2.0), layer(0.0, 0.0)]  # the forward has stored layer 0's K and V, not yet layer 1's
    calibration = KvCalibration(str(path), "run", layers)
    calibration.write(partial=False)
    assert not path.exists()
    layers[1].k_amax.fill_(7.0)
    layers[1].v_amax.fill_(1.0)
    calibration.write(partial=False)
    written = json.loads(path.read_text())
    assert written["k_absmax"] == [3.5, 7.0]
    assert written["v_scale"] == [pytest.approx(2.0 / 448), pytest.approx(1 / 448)]

    at_exit = KvCalibration(str(tmp_path / "exit.json"), "run", [layer(4.0, 1.0), layer(0.0, 0.0)])
    at_exit.write()  # a layer no request reached keeps the default scale
    assert json.loads((tmp_path / "exit.json").read_text())["k_scale"] == [pytest.approx(4.0 / 448), 1.0]
