"""Token healing's parts on SmolLM2's real tokenizer: the backed-off prompt, the first token's choices
(every token whose bytes start with the backed-off token's), the worker's first-step-only mask, and
the text that leaves the backed-off prefix out; and best_of's request checks."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from llaunch.runtime.constrained.row_state import RowConstraint
from llaunch.runtime.web.errors import ApiError
from llaunch.runtime.http.openai_protocol import CompletionRequest, completion_choices, completion_prompts
from llaunch.runtime.web.request_body import decode_body
from llaunch.runtime.detokenizer.incremental import IncrementalDecoder, PrefixStrip
from llaunch.runtime.http.token_healing import TokenHealer
from llaunch.runtime.ipc.messages import SamplingParams
from unit.test_openai_protocol import LIMITS, tok  # noqa: F401 (the fixture)


def test_a_prompt_ending_mid_word_backs_off_its_last_token(tok):  # noqa: F811
    ids = tok.encode("The capital of Fra")
    healing = TokenHealer(tok).heal(ids)
    assert healing.prompt_ids == ids[:-1]
    assert healing.prefix == tok.token_bytes(ids[-1]).decode() and healing.prefix.strip()
    whole = tok.encode("The capital of France")[len(ids) - 1]  # the token the tokenizer cuts for the word
    assert whole in healing.first_ids and ids[-1] in healing.first_ids
    vocab = [i for i in range(len(tok.hf)) if i not in tok.special_ids]
    expected = [i for i in vocab if tok.token_bytes(i).startswith(tok.token_bytes(ids[-1]))]
    assert healing.first_ids == expected  # bisection finds exactly the brute-force set


def test_prompts_that_cannot_be_healed_are_served_as_they_are(tok):  # noqa: F811
    healer = TokenHealer(tok)
    assert healer.heal(tok.encode("Hi")[:1]) is None  # one token: nothing would be left to prefill
    assert healer.heal(tok.encode("x") + [tok.hf.eos_token_id]) is None  # a special token


def test_the_first_token_only_is_restricted():
    row = RowConstraint(SamplingParams(max_new_tokens=4, heal_ids=[3, 40]), None, [0])
    mask = torch.full((1, 2), -1, dtype=torch.int32)
    row.fill(mask, 0, generated=0)
    bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")
    assert np.flatnonzero(bits).tolist() == [3, 40]
    row.accept(40)
    mask = torch.full((1, 2), -1, dtype=torch.int32)
    row.fill(mask, 0, generated=1)
    assert (mask == -1).all()


def test_a_healed_row_samples_as_a_plain_one_after_its_first_token():
    """Healing costs one masked step: then the row is plain greedy again (the decode graph's argmax)."""
    from llaunch.runtime.worker.sampling_state import SamplingState

    state = SamplingState(2, 64, torch.device("cpu"), eos_ids=(0,))
    state.set_rows([(0, SamplingParams(max_new_tokens=4, temperature=0.0, heal_ids=[3, 40]), [1, 2]),
                    (1, SamplingParams(max_new_tokens=4, temperature=0.0, min_tokens=2), [1, 2])])
    assert not state.plain_greedy([0]) and state.bitmask([0]) is not None
    logits = torch.zeros(2, 64)
    logits[:, 5] = 1.0  # the argmax, which healing excludes on the first token
    tokens = state.sample(logits, [0, 1], state.bitmask([0, 1])).tolist()
    assert tokens[0] in (3, 40)
    state.accept([0, 1], tokens)
    assert state.plain_greedy([0]) and state.bitmask([0]) is None
    assert not state.plain_greedy([1])  # min_tokens=2 still holds eos back for one more token


def test_the_text_leaves_the_backed_off_prefix_out():
    strip = PrefixStrip(" Fra")
    assert [strip(t) for t in (" F", "rance", " is")] == ["", "nce", " is"]
    assert PrefixStrip(" Fra")("France") == "nce"  # a decoder that drops the output's first space
    assert PrefixStrip("")("abc") == "abc"
    other = PrefixStrip(" Fra")  # output that does not start with the prefix is not cut
    assert [other(t) for t in ("</s>", " Fra")] == ["</s>", " Fra"]


def test_stop_strings_see_only_the_text_the_client_gets(tok):  # noqa: F811
    """The detokenizer strips the backed-off text before matching stop strings: a stop string inside
    it does not end the output, one in the output does."""
    healing = TokenHealer(tok).heal(tok.encode("The capital of Fra"))
    out_ids = tok.encode("The capital of France is Paris. France")[len(healing.prompt_ids):]

    def run(stop):
        decoder = IncrementalDecoder(tok.hf, stop=stop, heal_text=healing.prefix)
        text = "".join(decoder.push(t) for t in out_ids)
        return text + decoder.flush(), decoder.stopped

    assert run([]) == ("nce is Paris. France", False)
    assert run(["Fra"]) == ("nce is Paris. ", True)  # the first "Fra" is the prompt's, not the output's


def _completion(tok, **body):  # noqa: F811
    req = decode_body(json.dumps({"prompt": "Hello", **body}).encode(), CompletionRequest)
    return completion_choices(req, completion_prompts(req, tok, LIMITS), LIMITS, tok)


def test_best_of_runs_every_sample_and_asks_for_their_logprobs(tok):  # noqa: F811
    choices = _completion(tok, n=2, best_of=4, seed=7, max_tokens=3)
    assert len(choices) == 4 and [c.sampling.seed for c in choices] == [7, 8, 9, 10]
    assert all(c.sampling.logprobs for c in choices)
    assert not any(c.sampling.logprobs for c in _completion(tok, n=2, max_tokens=3))


@pytest.mark.parametrize("body", [{"n": 3, "best_of": 2}, {"n": 1, "best_of": 2, "stream": True}])
def test_bad_best_of(tok, body):  # noqa: F811
    with pytest.raises(ApiError) as e:
        _completion(tok, **body)
    assert (e.value.status, e.value.param) == (400, "best_of")
