"""Speculative decoding (spec=ngram and spec=draft) through the whole process graph on SmolLM2's real weights: greedy
text equals transformers' generate at concurrency 1 and 16, with max_tokens and stop strings landing
mid-proposal, and /metrics shows proposals were accepted (so speculation really ran)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from integration.conftest import SMOLLM2_DIR, start_server
from integration.server import metric_samples

# Copy-heavy prompts: the continuation repeats text the prompt holds, so n-gram proposals are accepted.
PROMPTS = [
    "Repeat the text.\nText: The cat sat on the mat and looked at the bird in the tall green tree.\n"
    "Repeat: The cat sat on the mat and looked at the bird in the tall green tree.\n"
    "Text: A small red boat sails across the quiet lake at dawn, and the fisherman waves.\nRepeat:",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
]
MAX_NEW = 24


@pytest.fixture(scope="module", params=["ngram", "draft", "draft-tp2-ahead"])
def server(request, tmp_path_factory):
    """Both proposers; the draft is SmolLM2 itself (the only real weights here): it proposes the model's
    own next tokens, through its own KV cache in the worker. Under tp2 each rank holds the whole draft
    and the first rank's proposals are broadcast (SmolLM2's 9 / 3 heads padded to split), there drafted ahead of
    each plan (spec.draft_ahead: every rank takes or drops them alike)."""
    method, *options = request.param.split("-")
    extra = [f"spec.draft_model_path={SMOLLM2_DIR}"] if method == "draft" else []
    if "tp2" in options:
        extra += ["parallel=tp2", "parallel.pad_heads=true"]
    if "ahead" in options:
        extra += ["spec.draft_ahead=true"]
    with start_server(tmp_path_factory, f"spec-{request.param}", [f"spec={method}", "spec.num_tokens=4", *extra]) as s:
        yield s


@pytest.fixture(scope="module")
def expected(oracles):
    """Per prompt: transformers' greedy continuation (token ids, cut after an eos)."""
    oracle = oracles("smollm2")
    eos = {oracle.tokenizer.convert_tokens_to_ids("<|im_end|>"), oracle.tokenizer.eos_token_id}
    out = []
    for prompt in PROMPTS:
        ids = oracle.greedy(oracle.tokenizer(prompt)["input_ids"], MAX_NEW)
        cut = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        out.append(ids[:cut])
    return oracle.tokenizer, out


def want_text(tokenizer, ids: list[int], max_tokens: int, stop: str | None) -> str:
    text = tokenizer.decode(ids[:max_tokens], skip_special_tokens=True)
    return text[:text.index(stop)] if stop and stop in text else text


def complete(server, prompt: str, max_tokens: int, stop: str | None) -> str:
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    out = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                    stop=[stop] if stop else None)
    return out.choices[0].text


def accepted(server) -> tuple[float, float]:
    return (sum(metric_samples(server.url, "spec_decode_num_accepted_tokens_total").values()),
            sum(metric_samples(server.url, "spec_decode_num_draft_tokens_total").values()))


def test_greedy_equals_transformers_at_concurrency_1_and_16(server, expected, request):
    tokenizer, ids = expected
    for i, prompt in enumerate(PROMPTS):  # one stream at a time
        assert complete(server, prompt, MAX_NEW, None) == want_text(tokenizer, ids[i], MAX_NEW, None)
    deadline = time.monotonic() + 10
    while accepted(server)[0] == 0 and time.monotonic() < deadline:  # the router reports every 0.25 s
        time.sleep(0.2)
    got, proposed = accepted(server)
    assert 0 < got <= proposed  # speculation ran and proposals were kept
    if request.node.callspec.params["server"].startswith("draft"):  # the model drafting for itself: its own next tokens
        assert got >= 0.9 * proposed, (got, proposed)

    # 16 at once: max_tokens and stop strings (a word from the middle of the continuation) end outputs mid-proposal
    cases = []
    for n in range(16):
        i = n % len(PROMPTS)
        full = tokenizer.decode(ids[i], skip_special_tokens=True)
        words = full.split()
        stop = words[len(words) // 2] if n % 3 == 1 and len(words) > 2 else None
        cases.append((i, [MAX_NEW, 9, 17, 5][n % 4], stop))
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(lambda c: complete(server, PROMPTS[c[0]], c[1], c[2]), cases))
    assert texts == [want_text(tokenizer, ids[i], mt, stop) for i, mt, stop in cases]
    assert any(stop for _, _, stop in cases)
