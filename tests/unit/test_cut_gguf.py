"""scripts/cut_gguf.py: SmolLM2's GGUF cut to a few blocks is a GGUF transformers and llaunch read as
that many layers, whose kept blocks are the source's tensors byte for byte (renumbered), whose other
tensors and tokenizer are unchanged, and whose token embedding is re-quantized when asked."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from fixtures.tiny_models import smollm2_gguf
from llaunch.runtime.models.checkpoint import read_checkpoint

pytestmark = pytest.mark.slow  # seconds a test: `make test` runs it, `make test-fast` does not

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    out = tmp_path_factory.mktemp("cut") / "cut.gguf"
    subprocess.run([sys.executable, str(REPO / "scripts" / "cut_gguf.py"), str(smollm2_gguf()), str(out),
                    "--blocks", "0,2,29", "--embedding", "Q4_0"], check=True, capture_output=True)
    return out


def test_kept_blocks_are_the_source_bytes_renumbered(cut):
    import gguf

    src = {t.name: t for t in gguf.GGUFReader(str(smollm2_gguf())).tensors}
    got = {t.name: t for t in gguf.GGUFReader(str(cut)).tensors}
    assert {n.split(".")[1] for n in got if n.startswith("blk.")} == {"0", "1", "2"}
    for new, old in ((0, 0), (1, 2), (2, 29)):
        for suffix in ("attn_q.weight", "ffn_down.weight", "attn_norm.weight"):
            a, b = got[f"blk.{new}.{suffix}"], src[f"blk.{old}.{suffix}"]
            assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
            assert np.array_equal(np.asarray(a.data), np.asarray(b.data))
    assert np.array_equal(np.asarray(got["output_norm.weight"].data), np.asarray(src["output_norm.weight"].data))
    emb = got["token_embd.weight"]
    assert emb.tensor_type == gguf.GGMLQuantizationType.Q4_0 and list(emb.shape) == list(src["token_embd.weight"].shape)
    # re-quantized from the source's values: the Q4_0 rounding of the source's rows
    rows = gguf.quants.dequantize(src["token_embd.weight"].data, src["token_embd.weight"].tensor_type)[:64]
    want = gguf.quants.dequantize(gguf.quants.quantize(rows, gguf.GGMLQuantizationType.Q4_0), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(gguf.quants.dequantize(emb.data, emb.tensor_type)[:64], want)


def test_the_cut_reads_as_a_three_layer_model_with_the_tokenizer(cut):
    from transformers import AutoTokenizer

    ckpt = read_checkpoint(str(cut))
    assert ckpt.arch["num_hidden_layers"] == 3 and ckpt.arch["vocab_size"] == 49152
    tok = AutoTokenizer.from_pretrained(cut.parent, gguf_file=cut.name)
    ref = AutoTokenizer.from_pretrained(smollm2_gguf().parent, gguf_file=smollm2_gguf().name)
    text = "Repeat this text exactly: the old lighthouse."
    assert tok(text).input_ids == ref(text).input_ids
    assert tok.chat_template == ref.chat_template
