"""Greedy output through the whole process graph and the official openai client equals transformers'
generate on the same weights (float32, CPU); logprobs equal transformers' log-softmax."""
from __future__ import annotations

import math

import pytest
from openai import OpenAI

from integration.conftest import start_server

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived",
    "1, 2, 3, 4,",
    "Écrire en français: les élèves",
]


def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def cut_at_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def check_greedy(server, oracle, model_name: str, max_new: int, eos: set[int]):
    api = client(server)
    for prompt in PROMPTS:
        prompt_ids = oracle.tokenizer(prompt)["input_ids"]
        want = cut_at_eos(oracle.greedy(prompt_ids, max_new), eos)
        out = api.completions.create(model=model_name, prompt=prompt, max_tokens=max_new, temperature=0,
                                     extra_body={"return_token_ids": True})
        choice = out.choices[0]
        got_ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
        assert got_ids == want, f"prompt {prompt!r}"
        assert choice.text == oracle.tokenizer.decode(want, skip_special_tokens=True)
        assert out.usage.prompt_tokens == len(prompt_ids)
        assert out.usage.completion_tokens == len(want)
        assert choice.finish_reason == ("stop" if want[-1] in eos else "length")


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_tiny_models_greedy_equals_transformers(family, tmp_path_factory, tiny_dirs, oracles):
    overrides = [f"model={family}", f"model.path={tiny_dirs[family]}", f"model.name=tiny-{family}",
                 "router.chunked_prefill_size=8", "router.batch_max_tokens=24"]  # force chunked prefill
    with start_server(tmp_path_factory, f"greedy-{family}", overrides) as server:
        check_greedy(server, oracles(family), f"tiny-{family}", max_new=24, eos=set())


# Qwen3 (q/k norms, head_dim 24 in a width of 64) found by model=auto, its 6 heads and 2 KV heads split over
# two ranks; Mistral's 5 heads over 1 KV head padded to 6 at tp2
@pytest.mark.parametrize("family,overrides", [("qwen3", ["model=auto", "parallel=tp2"]),
                                              ("mistral", ["model=mistral", "parallel=tp2", "parallel.pad_heads=true"])])
def test_qwen3_and_mistral_greedy_at_tp2_equals_transformers(family, overrides, tmp_path_factory, tiny_dirs, oracles):
    overrides = [*overrides, f"model.path={tiny_dirs[family]}", f"model.name=tiny-{family}",
                 "router.chunked_prefill_size=8", "router.batch_max_tokens=24"]  # force chunked prefill
    with start_server(tmp_path_factory, f"greedy-{family}", overrides) as server:
        check_greedy(server, oracles(family), f"tiny-{family}", max_new=24, eos=set())


# The MoE families found by model=auto: Qwen3-MoE on one rank and with each expert's columns split over two ranks,
# Qwen2-MoE (its shared expert, a dense layer) likewise and with whole experts on each rank (parallel.ep=2), Mixtral
# with two whole experts on each rank
@pytest.mark.parametrize("family,overrides", [("qwen3_moe", []), ("qwen3_moe", ["parallel=tp2"]),
                                              ("qwen2_moe", ["parallel=tp2"]),
                                              ("qwen2_moe", ["parallel=tp2", "parallel.ep=2"]),
                                              ("mixtral", ["parallel=tp2", "parallel.ep=2"])])
def test_moe_greedy_equals_transformers(family, overrides, tmp_path_factory, tiny_dirs, oracles):
    overrides = ["model=auto", *overrides, f"model.path={tiny_dirs[family]}", f"model.name=tiny-{family}",
                 "router.chunked_prefill_size=8", "router.batch_max_tokens=24"]  # force chunked prefill
    with start_server(tmp_path_factory, f"greedy-{family}", overrides) as server:
        check_greedy(server, oracles(family), f"tiny-{family}", max_new=24, eos=set())


# Gemma 2 (5 heads over 1 KV head padded to 6 at tp2, soft-caps, a 6-token window in its local layers), Gemma 3
# (3 heads padded to 4, layers local, local, global with a 5-token window, local rotary base) and Phi-3 (fused
# tensors split over the ranks, a 12-token window in every layer, partial LongRoPE) found by model=auto: each prompt
# and its 24 tokens outgrow the windows
@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3"])
def test_gemma_and_phi3_greedy_at_tp2_equals_transformers(family, tmp_path_factory, tiny_dirs, oracles):
    overrides = ["model=auto", "parallel=tp2", "parallel.pad_heads=true", f"model.path={tiny_dirs[family]}",
                 f"model.name=tiny-{family}", "router.chunked_prefill_size=8", "router.batch_max_tokens=24"]
    with start_server(tmp_path_factory, f"greedy-{family}", overrides) as server:
        check_greedy(server, oracles(family), f"tiny-{family}", max_new=24, eos=set())


def test_smollm2_greedy_equals_transformers(smollm2_server, oracles):
    oracle = oracles("smollm2")
    eos = {oracle.tokenizer.convert_tokens_to_ids("<|im_end|>"), oracle.tokenizer.eos_token_id}
    check_greedy(smollm2_server, oracle, "smollm2-135m", max_new=32, eos=eos)


def test_smollm2_chat_uses_the_checkpoint_template_and_knows_paris(smollm2_server, oracles):
    oracle = oracles("smollm2")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_ids = oracle.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=True)["input_ids"]
    eos = {oracle.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    want = cut_at_eos(oracle.greedy(list(prompt_ids), 40), eos)
    out = client(smollm2_server).chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=40,
                                                         temperature=0)
    text = out.choices[0].message.content
    assert text == oracle.tokenizer.decode(want, skip_special_tokens=True).strip() or \
        text == oracle.tokenizer.decode(want, skip_special_tokens=True)
    assert "Paris" in text
    assert out.usage.prompt_tokens == len(prompt_ids)


def test_top_logprobs_match_transformers_log_softmax(smollm2_server, oracles):
    oracle = oracles("smollm2")
    prompt = "The capital of Germany is"
    ids = oracle.tokenizer(prompt)["input_ids"]
    out = client(smollm2_server).completions.create(model="smollm2-135m", prompt=prompt, max_tokens=3,
                                                    temperature=0, logprobs=5,
                                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    gen = choice.model_extra.get("token_ids") if choice.model_extra else None
    gen = gen or choice.token_ids
    for step, token_id in enumerate(gen):
        ref = oracle.next_logprobs(ids + gen[:step])
        assert math.isclose(choice.logprobs.token_logprobs[step], ref[token_id].item(), abs_tol=2e-3)
        ref_top = ref.topk(5)
        got_top = sorted(choice.logprobs.top_logprobs[step].values(), reverse=True)
        assert got_top == pytest.approx(ref_top.values.tolist(), abs=2e-3)
        want_strings = {oracle.tokenizer.convert_ids_to_tokens(i) for i in ref_top.indices.tolist()}
        decoded = {oracle.tokenizer.decode([i]) for i in ref_top.indices.tolist()}
        assert set(choice.logprobs.top_logprobs[step]) <= want_strings | decoded
