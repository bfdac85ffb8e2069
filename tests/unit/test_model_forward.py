"""The decoder against transformers (float32, CPU) on the same weights: whole-prompt prefill, chunked
prefill over a cached prefix, and teacher-forced decode steps mixed with another sequence's prefill; for the
dense families, the MoE ones (Qwen3-MoE, Qwen2-MoE with its shared expert and a dense layer, Mixtral), Gemma 2 and 3
(windows shorter than the prompts, soft-caps, Gemma 3's local rotary), Phi-3 (fused tensors, partial LongRoPE, a
window in every layer) and SmolLM2."""
from __future__ import annotations

import pytest
import torch

from fixtures.forward_batches import SlotTables
from fixtures.tiny_models import model_config_from_folder, smollm2_dir, write_tiny_checkpoint
from llaunch.runtime.models.loader import build_model

PROMPTS = ["What is the capital of France? Answer in one word.",
           "Write a haiku about the sea, and explain its meaning in a sentence or two."]
NEW_TOKENS = 5


class Oracle:
    """transformers' model on the same folder: greedy continuation and logits of every position."""

    def __init__(self, hf, prompt_ids: list[int]):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
            self.tokens = out[0].tolist()  # prompt + greedy continuation
            assert len(self.tokens) == len(prompt_ids) + NEW_TOKENS
            self.logits = hf(out).logits[0].float()  # [len(tokens), vocab]
        self.prompt_len = len(prompt_ids)

    def greedy(self) -> list[int]:
        return self.tokens[self.prompt_len:]


def assert_close(ours: torch.Tensor, ref: torch.Tensor):
    # float32 with a different op order: agreement to ~1e-4 of the logit scale
    tol = 1e-4 * max(1.0, ref.abs().max().item())
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= tol, f"max |ours - transformers| = {diff:.3g} > {tol:.3g}"


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-llama", "tiny-qwen3", "tiny-mistral", "tiny-qwen3_moe",
                                        "tiny-qwen2_moe", "tiny-mixtral", "tiny-gemma2", "tiny-gemma3_text",
                                        "tiny-phi3", "smollm2"])
def setup(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if request.param == "smollm2":
        folder = smollm2_dir()
        if not (folder / "model.safetensors").is_file():
            pytest.fail(f"{folder} missing: run scripts/prepare_models.py (make setup)")
    else:
        family = request.param.split("-")[1]
        folder = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), family)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]  # BatchEncoding in 5.x
    model = build_model(model_config_from_folder(folder), device=torch.device("cpu"), dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return model, [Oracle(hf, p) for p in prompts]


def test_prefill_whole_prompt(setup):
    model, (a, _) = setup
    tables = SlotTables(model)
    p = a.prompt_len
    logits = model.forward(tables.batch(prefill=[(0, a.tokens[:p])], all_logits=True), tables.kv)
    assert_close(logits, a.logits[:p])
    assert logits[-1].argmax().item() == a.greedy()[0]


def test_prefill_in_two_chunks_over_cached_prefix(setup):
    model, (a, _) = setup
    tables = SlotTables(model, seed=1)
    p = a.prompt_len
    cut = p // 3
    first = model.forward(tables.batch(prefill=[(2, a.tokens[:cut])], all_logits=True), tables.kv)
    second = model.forward(tables.batch(prefill=[(2, a.tokens[cut:p])], all_logits=True), tables.kv)
    assert_close(first, a.logits[:cut])
    assert_close(second, a.logits[cut:p])


def test_decode_steps_mixed_with_another_prefill(setup):
    """A decodes teacher-forced while B prefills in two chunks, then both decode together."""
    model, (a, b) = setup
    tables = SlotTables(model, seed=2)
    pa, pb = a.prompt_len, b.prompt_len
    cut = pb // 2
    greedy_a, greedy_b = [], []
    logits = model.forward(tables.batch(prefill=[(1, a.tokens[:pa])]), tables.kv)
    assert_close(logits[0], a.logits[pa - 1])
    greedy_a.append(logits[0].argmax().item())
    steps = [  # (A's decode token, B's chunk, B's position whose logits come back)
        (a.tokens[pa], b.tokens[:cut], cut - 1),  # mixed: decode + first chunk
        (a.tokens[pa + 1], b.tokens[cut:pb], pb - 1),  # mixed: decode + chunk over a cached prefix
    ]
    for token_a, chunk_b, pos_b in steps:
        logits = model.forward(tables.batch(decode=[(1, token_a)], prefill=[(3, chunk_b)]), tables.kv)
        assert_close(logits[0], a.logits[tables.lens[1] - 1])
        assert_close(logits[1], b.logits[pos_b])
        greedy_a.append(logits[0].argmax().item())
    greedy_b.append(logits[1].argmax().item())
    for j in range(NEW_TOKENS - 3):  # decode-only batches of both sequences
        logits = model.forward(tables.batch(decode=[(1, a.tokens[pa + 2 + j]), (3, b.tokens[pb + j])]), tables.kv)
        assert_close(logits[0], a.logits[pa + 2 + j])
        assert_close(logits[1], b.logits[pb + j])
        greedy_a.append(logits[0].argmax().item())
        greedy_b.append(logits[1].argmax().item())
    assert greedy_a == a.greedy()[: len(greedy_a)]
    assert greedy_b == b.greedy()[: len(greedy_b)]


def test_logits_only_for_requested_rows(setup):
    model, (a, _) = setup
    tables = SlotTables(model, seed=3)
    batch = tables.batch(prefill=[(0, a.tokens[: a.prompt_len])])
    batch.logits_index = torch.tensor([2, 0], dtype=torch.long)
    logits = model.forward(batch, tables.kv)
    assert logits.shape == (2, model.arch.vocab_size)
    assert_close(logits, a.logits[[2, 0]])


def test_kv_bytes_per_token_is_what_a_slot_of_the_cache_takes(setup):
    """The worker sizes its KV cache by kv_bytes_per_token: it must be what make_kv_cache allocates a slot."""
    model, _ = setup
    kv = model.make_kv_cache(10, 3, 64)
    assert model.kv_bytes_per_token * 10 == sum(t.nbytes for t in (*kv.k, *kv.v))


def test_decode_only_step_takes_the_final_norm_without_gathers(setup):
    """A decode-only step (every_token: logits for tokens 0..T-1) adds the residual in the final norm
    instead of gathering rows first: the same logits as the gather path."""
    model, (a, b) = setup
    out = []
    for every_token in (False, True):
        tables = SlotTables(model, seed=5)
        model.forward(tables.batch(prefill=[(0, a.tokens[:a.prompt_len]), (1, b.tokens[:b.prompt_len])]), tables.kv)
        batch = tables.batch(decode=[(0, a.tokens[a.prompt_len]), (1, b.tokens[b.prompt_len])])
        assert batch.every_token
        batch.every_token = every_token
        out.append(model.forward(batch, tables.kv))
    assert torch.equal(out[0], out[1])
    assert_close(out[1][0], a.logits[a.prompt_len])


# Each variant the tiny Mistral / Gemma / Phi-3 checkpoints use changes their logits: without it the whole-prompt
# prefill is off transformers' by 10x what test_prefill_whole_prompt allows, or more (those tests would catch its loss)
VARIANTS = [("mistral", "sliding_window"), ("gemma2", "sliding_window"), ("gemma2", "attn_logit_softcapping"),
            ("gemma2", "final_logit_softcapping"), ("gemma2", "query_pre_attn_scalar"), ("gemma3_text", "sliding_window"),
            ("gemma3_text", "rope_local_base_freq"), ("gemma3_text", "rope_scaling"), ("phi3", "sliding_window"),
            ("phi3", "rope_scaling")]


@pytest.mark.parametrize("family,key", VARIANTS)
def test_each_variant_matters_at_the_tiny_shapes(tmp_path, family, key):
    from transformers import AutoModelForCausalLM

    folder = write_tiny_checkpoint(tmp_path / family, family)
    ids = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    without = model_config_from_folder(folder, **{key: None})
    model = build_model(without, device=torch.device("cpu"), dtype=torch.float32)
    tables = SlotTables(model)
    logits = model.forward(tables.batch(prefill=[(0, ids)], all_logits=True), tables.kv)
    assert (logits - ref).abs().max().item() > 10 * 1e-4 * max(1.0, ref.abs().max().item())
