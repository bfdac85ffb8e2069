"""Structured output and token exclusions in the worker, against oracles: xgrammar's own matcher (a
keyword we refuse is one its grammar does not enforce), a plain-Python reading of each bitmask row,
and torch (logit_bias and min_p on the logits). Real tokenizer: SmolLM2's."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from unit.http_support import smollm2_tokenizer
from llaunch.runtime.constrained.compiler import MAX_SPEC_CHARS, ConstraintError, GrammarCompiler
from llaunch.runtime.constrained.json_schema import UNENFORCED
from llaunch.runtime.constrained.row_state import RowConstraint
from llaunch.runtime.ipc.messages import Constraint, SamplingParams
from llaunch.runtime.worker.sampling_state import SamplingState

EOS = 2
VOCAB = 49152


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok.hf, VOCAB)


def _xgrammar_accepts(compiler, schema: dict, instance) -> bool:
    """Does xgrammar's own grammar of `schema` (our check bypassed) accept `instance` whole?"""
    import xgrammar as xgr

    grammar = compiler._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    matcher = xgr.GrammarMatcher(grammar)
    return matcher.accept_string(json.dumps(instance)) and matcher.accept_token(EOS)


OBJ_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
# keyword → (schema, an instance that breaks it, one that keeps it)
UNENFORCED_CASES = {
    "not": ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, {"a": "x"}, {"a": 1}),
    "if": (dict(OBJ_AB, **{"if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}), {"a": 1},
           {"a": 1, "b": 2}),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1], [1, 2]),
    "dependentRequired": (dict(OBJ_AB, dependentRequired={"a": ["b"]}), {"a": 1}, {"a": 1, "b": 2}),
    "contains": ({"type": "array", "contains": {"type": "integer"}}, ["a"], [1]),
    "patternProperties": ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, {"xa": "s"},
                          {"xa": 1}),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^a"}}, {"b": 1}, {"ab": 1}),
    "allOf": ({"allOf": [dict(OBJ_AB, required=["a"]), {"required": ["b"]}]}, {"a": 1}, {"a": 1, "b": 2}),
}


@pytest.mark.parametrize("keyword", sorted(UNENFORCED_CASES))
def test_a_refused_keyword_is_one_the_grammar_does_not_enforce(compiler, keyword):
    schema, breaks, keeps = UNENFORCED_CASES[keyword]
    # xgrammar lets the broken instance through or refuses the good one: output would not validate
    assert _xgrammar_accepts(compiler, schema, breaks) or not _xgrammar_accepts(compiler, schema, keeps)
    nested = {"type": "object", "properties": {"outer": schema}, "$defs": {"x": schema}}
    with pytest.raises(ConstraintError, match=f"/properties/outer(/.*)?/{keyword}.*/\\$defs/x(/.*)?/{keyword}"):
        compiler.compile(Constraint("json_schema", json.dumps(nested)))


def test_every_refused_keyword_has_its_case():
    assert set(UNENFORCED) - {"then", "else", "minContains", "maxContains"} | {"allOf"} == set(UNENFORCED_CASES)


ENFORCED_CASES = [  # served: the grammar refuses the broken instance and takes the good one
    ({"type": "string", "pattern": "^[0-9]{3}$"}, "12a", "123"),
    ({"enum": ["red", "green"]}, "blue", "green"),
    ({"type": "integer", "minimum": 5, "maximum": 9}, 3, 7),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}, [1], [1, 2]),
    ({"type": "object", "properties": {"p": {"$ref": "#/$defs/q"}}, "required": ["p"],
      "$defs": {"q": {"type": "boolean"}}}, {"p": 1}, {"p": True}),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, None, "x"),
    ({"type": "string", "format": "date"}, "tomorrow", "2026-12-01"),
]


@pytest.mark.parametrize("schema,breaks,keeps", ENFORCED_CASES)
def test_served_keywords_are_enforced(compiler, schema, breaks, keeps):
    compiler.compile(Constraint("json_schema", json.dumps(schema)))
    assert _xgrammar_accepts(compiler, schema, keeps) and not _xgrammar_accepts(compiler, schema, breaks)


def test_compiles_once_per_spec_and_refuses_bad_specs(compiler):
    c = Constraint("regex", "[a-z]+")
    assert compiler.compile_async(c) is compiler.compile_async(Constraint("regex", "[a-z]+"))
    for bad in (Constraint("regex", "(ab"), Constraint("grammar", "root ::= nowhere"),
                Constraint("json_schema", '{"type": "strnig"}'), Constraint("json_schema", "{"),
                Constraint("made_up", "x"), Constraint("regex", "a" * (MAX_SPEC_CHARS + 1))):
        with pytest.raises(ConstraintError):
            compiler.compile(bad)


def _allowed(mask: torch.Tensor, i: int) -> set[int]:
    words = mask[i].numpy().view(np.uint32)
    return {t for t in range(VOCAB) if words[t >> 5] >> (t & 31) & 1}


def _fill(rc: RowConstraint, generated: int) -> set[int]:
    mask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    rc.fill(mask, 0, generated)
    return _allowed(mask, 0)


def test_bitmask_rows_match_a_plain_reading_of_the_exclusions():
    everything = set(range(VOCAB))
    sp = SamplingParams(max_new_tokens=9, banned_ids=[5, 70], min_tokens=2, stop_token_ids=[9])
    rc = RowConstraint(sp, None, [EOS, 9])
    assert _fill(rc, 0) == everything - {5, 70, EOS, 9}  # min_tokens holds back every stop token
    assert _fill(rc, 2) == everything - {5, 70}
    only = RowConstraint(SamplingParams(max_new_tokens=4, allowed_ids=[3, 31, 32, 40000, 70]), None, [EOS])
    assert _fill(only, 0) == {3, 31, 32, 40000, 70}
    clash = RowConstraint(SamplingParams(max_new_tokens=4, allowed_ids=[7], banned_ids=[7]), None, [EOS])
    assert _fill(clash, 0) == {EOS}  # nothing is left: the output ends

    seqs = RowConstraint(SamplingParams(max_new_tokens=9, banned_sequences=[[10, 11, 12], [13]]), None, [EOS])
    assert seqs.needs_history and _fill(seqs, 0) == everything - {13}
    for token, banned_next in ((10, {13}), (11, {12, 13}), (12, {13}), (10, {13}), (11, {12, 13})):
        seqs.accept(token)
        assert _fill(seqs, 0) == everything - banned_next


def test_grammar_rows_follow_the_matcher(compiler, tok):
    sp = SamplingParams(max_new_tokens=8, constraint=Constraint("regex", "(yes|no)"))
    rc = RowConstraint(sp, compiler.compile_async(sp.constraint), [EOS])
    pieces = {t: tok.token_bytes(t) for t in range(len(tok.hf))}
    assert _fill(rc, 0) == {t for t, b in pieces.items() if b and b in (b"y", b"ye", b"yes", b"n", b"no")}
    rc.accept(tok.encode_plain("ye")[0])
    assert _fill(rc, 1) == {t for t, b in pieces.items() if b and b"ye" + b in (b"yes",)}
    rc.accept(tok.encode_plain("s")[0])
    assert _fill(rc, 2) == {EOS}


def _state(compiler=None, rows: int = 4) -> SamplingState:
    return SamplingState(rows, VOCAB, torch.device("cpu"), (EOS,), (lambda: compiler) if compiler else None)


def test_logit_bias_moves_the_greedy_choice_and_logprobs_stay_the_models():
    state = _state()
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    target = int(torch.argsort(logits[0])[VOCAB // 2])  # a middling token
    state.set_rows([(0, SamplingParams(max_new_tokens=4, temperature=0.0, bias_ids=[target], bias_values=[100.0]), [1]),
                    (1, SamplingParams(max_new_tokens=4, temperature=0.0, bias_ids=[int(logits[1].argmax())],
                                       bias_values=[-100.0]), [1])])
    reference = logits.clone()
    reference[0, target] += 100.0
    reference[1, int(logits[1].argmax())] -= 100.0
    tokens = state.sample(logits.clone(), [0, 1], state.bitmask([0, 1]))
    assert tokens.tolist() == reference.argmax(-1).tolist() and tokens[0] == target
    state.top_logprobs[0] = 0
    chosen, *_ = state.logprobs(logits, [0], tokens[:1])
    assert math.isclose(chosen.item(), torch.log_softmax(logits[0], -1)[target].item(), rel_tol=1e-5)


@pytest.mark.slow  # seconds: make test runs it, make test-fast does not
def test_min_p_never_samples_a_token_below_its_floor():
    state = _state(rows=1)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    probs = torch.softmax(logits[0], -1)
    floor = 0.2 * probs.max()
    for seed in range(40):
        state.set_rows([(0, SamplingParams(max_new_tokens=4, temperature=1.0, min_p=0.2, seed=seed), [1])])
        token = int(state.sample(logits.clone(), [0], state.bitmask([0]))[0])
        assert probs[token] >= floor
    assert (probs >= floor).sum() > 1  # more than one token was possible


def test_a_sampled_row_keeps_to_its_grammar(compiler, tok):
    """Random logits, temperature 1: every draw is a token the regex allows, ending on eos."""
    state = _state(compiler, rows=2)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3, constraint=Constraint("regex", "[0-9]{3}-[a-c]"))
    state.set_rows([(1, sp, [1])])
    out, gen = [], torch.Generator().manual_seed(2)
    for _ in range(16):
        token = int(state.sample(torch.randn(1, VOCAB, generator=gen), [1], state.bitmask([1]))[0])
        state.accept([1], [token])
        if token == EOS:
            break
        out.append(token)
    assert token == EOS and re.fullmatch("[0-9]{3}-[a-c]", tok.hf.decode(out))


def test_a_step_mask_equals_its_rows_filled_one_by_one(compiler, tok):
    """The batched fill (xgrammar's batch matcher, reused buffers) against each row's own fill, over
    steps that follow sampled tokens: grammar rows, grammar plus banned ids and min_tokens,
    exclusions without a grammar, and unconstrained rows."""
    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                         "required": ["name", "n"]})
    params = [SamplingParams(max_new_tokens=20, constraint=Constraint("json_schema", schema)),
              None,
              SamplingParams(max_new_tokens=20, constraint=Constraint("regex", "[a-z]{3,9}( [a-z]+)*"),
                             banned_ids=tok.encode_plain("e"), min_tokens=4),
              SamplingParams(max_new_tokens=20, banned_ids=[5, 70], min_tokens=3),
              SamplingParams(max_new_tokens=20, constraint=Constraint("json_schema", schema))]
    state = _state(compiler, rows=len(params))
    twins = [None if sp is None else RowConstraint(sp, None if sp.constraint is None else
                                                   compiler.compile_async(sp.constraint), [EOS])
             for sp in params]
    state.set_rows([(r, sp, []) for r, sp in enumerate(params) if sp is not None])
    rows, gen = [4, 0, 1, 2, 3], torch.Generator().manual_seed(0)
    for step in range(12):
        mask = state.bitmask(rows).clone()
        for i, r in enumerate(rows):
            expected = set(range(VOCAB)) if twins[r] is None else _fill(twins[r], step)
            assert _allowed(mask, i) == expected, (step, r)
        tokens = []
        for i, r in enumerate(rows):  # a random allowed token per row, as a sampler would draw
            allowed = sorted(_allowed(mask, i))
            tokens.append(allowed[int(torch.randint(len(allowed), (1,), generator=gen))])
        state.advance(rows)
        state.accept(rows, tokens)
        for r, token in zip(rows, tokens):
            if twins[r] is not None:
                twins[r].accept(token)


def test_a_constraint_no_text_can_match_is_refused_and_a_dead_end_ends_the_output(compiler, tok):
    """A spec that allows no first token (a regex of an empty class, a rule that only refers to itself)
    is a ConstraintError, not a mask of nothing the sampler draws garbage from; a grammar that dead-ends
    after its first token ends the output there (only the stop tokens are left), in the step's batched
    mask as in the row's own fill."""
    for bad in (Constraint("regex", "[^\\s\\S]"), Constraint("grammar", "root ::= a\na ::= a")):
        with pytest.raises(ConstraintError, match="no text"):
            compiler.compile(bad)
    dead = SamplingParams(max_new_tokens=8, constraint=Constraint("grammar", 'root ::= "a" b\nb ::= b'))
    rc = RowConstraint(dead, compiler.compile_async(dead.constraint), [EOS])
    [a] = tok.encode_plain("a")
    assert a in _fill(rc, 0)
    rc.accept(a)
    assert _fill(rc, 1) == {EOS}
    state = _state(compiler, rows=1)
    state.set_rows([(0, dead, [])])
    state.advance([0])
    state.accept([0], [a])
    assert _allowed(state.bitmask([0]).clone(), 0) == {EOS}


def test_a_ref_outside_the_schema_is_refused(compiler):
    """xgrammar does not fetch `$ref: http://...` and lets any value through in its place (the output
    once was `""` for a ref to an integer schema): refused, naming it; a local ref is served."""
    for ref in ("http://example.com/int.json", "other.json#/x", "urn:x"):
        schema = {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}
        with pytest.raises(ConstraintError, match="/properties/a/\\$ref"):
            compiler.compile(Constraint("json_schema", json.dumps(schema)))
    local = {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"],
             "$defs": {"n": {"type": "integer"}}}
    compiler.compile(Constraint("json_schema", json.dumps(local)))
    assert _xgrammar_accepts(compiler, local, {"a": 1}) and not _xgrammar_accepts(compiler, local, {"a": "x"})
