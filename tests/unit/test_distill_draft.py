"""scripts/distill_draft.py: a draft cut from a model's blocks, trained towards the model's next-token
distribution, agrees with the model's greedy tokens where the cut alone does not (spec=draft's proposals are
kept only where they equal the model's)."""
from __future__ import annotations

import copy
import importlib.util
import sys

import numpy as np
import pytest
import torch

from unit.spec_support import REPO


def _script(name: str):
    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_copy_sequences_repeat_one_passage_of_a_file_to_the_length_asked():
    distill = _script("distill_draft")
    files = [list(range(100, 400)), list(range(500, 520))]
    sep = [7, 7]
    sources = set()
    for seed in range(8):
        seq = distill.copy_sequence(files, 256, sep, np.random.default_rng(seed))
        assert len(seq) == 256
        first = seq.index(7)  # the passage ends where the first separator starts
        passage = seq[:first]
        assert seq[first:first + 2] == sep
        again = seq[first + 2:first + 2 + len(passage)]
        assert again == passage[:len(again)]
        source = next(f for f in files if passage[0] in f)
        assert passage == source[source.index(passage[0]):][:len(passage)]  # a run of one file's tokens
        assert len(passage) >= min(32, len(source))  # a file shorter than 32 tokens whole
        sources.add(source[0])
    assert sources == {100, 500}  # a long file's passages and a short one's


@pytest.mark.slow
def test_distilling_a_cut_of_two_blocks_makes_it_agree_with_the_model_it_was_cut_from():
    from transformers import LlamaConfig, LlamaForCausalLM

    distill = _script("distill_draft")
    keep_blocks = _script("spec_acceptance").keep_blocks
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=5,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, initializer_range=0.1)  # at 0.02 every argmax is one token
    teacher = LlamaForCausalLM(config).eval()
    draft = copy.deepcopy(teacher)
    keep_blocks(draft, [0, 4])
    embedding = draft.model.embed_tokens.weight.clone()
    teacher_state = {k: v.clone() for k, v in teacher.state_dict().items()}
    rng = np.random.default_rng(0)
    files = [rng.integers(3, 97, size=200).tolist() for _ in range(20)]

    def batch(gen):
        return torch.tensor([distill.copy_sequence(files, 64, [1, 2], gen) for _ in range(8)])

    eval_ids = batch(np.random.default_rng(1))
    lines = []
    steps, before, after = distill.distill(teacher, draft, lambda: batch(rng), eval_ids, steps=80, seconds=600,
                                           lr=3e-3, eval_every=40, log=lines.append)
    assert steps == 80 and len(lines) == 5  # the parameters, step 0, steps 40 and 80, the end
    # a random model is a hard one to imitate: the cut 7.8%, distilled 80 steps 23.2% (2026-12-07)
    assert after >= before + 0.1, (before, after)
    assert torch.equal(draft.model.embed_tokens.weight, embedding)  # the vocabulary space (and tied head) frozen
    assert all(torch.equal(v, teacher_state[k]) for k, v in teacher.state_dict().items())  # the model untouched
