"""What greedy n-gram speculation would accept on a model and a workload, without a server: transformers' greedy
output for each prompt, replayed through the router's proposer (runtime/router/ngram.py) as spec=ngram verifies it
(each verify keeps the proposal's longest prefix that equals the greedy tokens, plus one token of the model's own).
Prints, per prompt and their mean, per k: the tokens a verify yields, as a served run's `Spec decode tokens per
verify step` counts them (1 + accepted / proposals), and the output tokens a step, steps without a proposal
included (the speed-up's ceiling where a verify costs a decode step). Chained verifies and backoffs aside.

Also how much of a passage's second copy the model predicts when the passage is given twice (teacher-forced
top-1), the copying that n-gram proposals live on. --blocks keeps some of the model's decoder blocks, as
scripts/cut_gguf.py cuts a GGUF (gpu_run.sh's SmolLM2 cuts), to see what a cut still copies. --draft-blocks: what
spec=draft would accept with the model cut further to these of its blocks as the draft (greedy proposals of k
tokens: each verify keeps the draft's tokens while they equal the model's greedy ones).

    python scripts/spec_acceptance.py --model .models/smollm2-135m [--blocks 0-2,7,8] [--prompts 4] [--k 4 8]
        [--ngram-max 3] [--cut]
    python scripts/spec_acceptance.py --model .models/spec/smollm2-135m --draft-blocks 0-1,16-17
    python scripts/spec_acceptance.py --model .models/spec/smollm2-135m --draft /tmp/draft   (a draft's own folder:
        scripts/distill_draft.py writes one)
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llaunch.runtime.config import SpecConfig  # noqa: E402  (the served defaults)


def replay(prompt: Sequence[int], output: Sequence[int], k: int, ngram_min: int = SpecConfig.ngram_min,
           ngram_max: int = SpecConfig.ngram_max, repeat: bool = True) -> tuple[float, float]:
    """Greedy `output` produced by n-gram speculation over `prompt`: (tokens a verify yields, as the server's
    `1 + accepted / proposals` counts them: steps that proposed nothing are not verifies; output tokens a step,
    those steps included)."""
    from llaunch.runtime.router.ngram import propose

    history, done, steps, proposals, accepted = list(prompt), 0, 0, 0, 0
    while done < len(output):
        proposal = propose(history, k, ngram_min, ngram_max, repeat)
        kept = 0
        while kept < len(proposal) and done + kept < len(output) and proposal[kept] == output[done + kept]:
            kept += 1
        step = min(kept + 1, len(output) - done)  # the kept tokens and the model's own after them
        history += output[done:done + step]
        done += step
        steps += 1
        proposals += bool(proposal)
        accepted += kept
    return 1 + accepted / max(proposals, 1), len(output) / max(steps, 1)


def replay_draft(agree: Sequence[bool], k: int) -> tuple[float, float]:
    """The same for a greedy draft: agree[j] says whether the draft's argmax after the prompt and output[:j] is
    output[j] (teacher-forced: a proposal is kept only while it equals the output, so its tokens after the first
    mismatch never count). Every step proposes k tokens."""
    done, steps, accepted = 0, 0, 0
    while done < len(agree):
        kept = 0
        while kept < k and done + kept < len(agree) and agree[done + kept]:
            kept += 1
        done += min(kept + 1, len(agree) - done)
        steps += 1
        accepted += kept
    return 1 + accepted / max(steps, 1), len(agree) / max(steps, 1)


def keep_blocks(model, blocks: list[int]) -> None:
    """Keep only these decoder blocks (renumbered), as cut_gguf.py cuts a checkpoint."""
    import torch

    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([layers[i] for i in blocks])
    for j, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = j
    model.config.num_hidden_layers = len(blocks)


def copy_accuracy(model, passage: list[int], device="cpu") -> float:
    """Top-1 agreement with the passage's second copy, given the passage twice (teacher-forced)."""
    import torch

    ids = torch.tensor([passage + passage], device=device)
    with torch.no_grad():
        pred = model(ids).logits[0].argmax(-1)
    n = len(passage)
    return (pred[n:-1] == ids[0, n + 1:]).float().mean().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face model folder (scripts/prepare_models.py writes one)")
    ap.add_argument("--blocks", default=None, help="decoder blocks to keep, as cut_gguf.py --blocks (default: all)")
    ap.add_argument("--draft-blocks", default=None,
                    help="spec=draft instead of ngram: the draft is the model (after --blocks) cut to these blocks")
    ap.add_argument("--draft", default=None, help="spec=draft instead of ngram: the draft's Hugging Face folder")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8], help="tokens proposed per verify")
    ap.add_argument("--seed", type=int, default=24, help="bench_spec.sh's c1 seed")
    ap.add_argument("--ngram-max", type=int, default=SpecConfig.ngram_max, help="spec.ngram_max (3 before 2026-12-06)")
    ap.add_argument("--cut", action="store_true",
                    help="proposals stop at the present (runtime/router/ngram.py's repeat=False: before 2026-12-06)")
    ap.add_argument("--device", default=None, help="where the models run (default: cuda where there is one)")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from bench_spec import corpus_passages, text_copy_prompts, tokenizer_of
    from cut_gguf import parse_blocks

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    if args.blocks:
        keep_blocks(model, parse_blocks(args.blocks, model.config.num_hidden_layers))
    draft = None
    if args.draft_blocks:
        draft = copy.deepcopy(model)
        keep_blocks(draft, parse_blocks(args.draft_blocks, model.config.num_hidden_layers))
    elif args.draft:
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model.to(dev)
    if draft is not None:
        draft.to(dev)
    tokenize = tokenizer_of(args.model)
    # as the benchmark's requests (ignore_eos): an end-of-sequence token is output like any other, no stop
    greedy = copy.deepcopy(model.generation_config)
    greedy.eos_token_id, greedy.do_sample, greedy.max_new_tokens = None, False, args.output_len
    sums = {k: (0.0, 0.0) for k in args.k}
    for i, prompt in enumerate(text_copy_prompts(args.prompts, args.input_len, tokenize, args.seed)):
        with torch.no_grad():
            ids = torch.tensor([prompt], device=dev)
            out = model.generate(ids, generation_config=greedy)[0, len(prompt):].tolist()
        if draft is None:
            per = {k: replay(prompt, out, k, ngram_max=args.ngram_max, repeat=not args.cut) for k in args.k}
        else:  # the draft's argmax after every prefix of the output, in one forward
            with torch.no_grad():
                ids = torch.tensor([prompt + out], device=dev)
                guess = draft(ids).logits[0, len(prompt) - 1:-1].argmax(-1).tolist()
            agree = [g == t for g, t in zip(guess, out)]
            per = {k: replay_draft(agree, k) for k in args.k}
        print(f"prompt {i}: " + "  ".join(f"k={k} {v:.2f} a verify, {s:.2f} a step" for k, (v, s) in per.items()),
              flush=True)
        for k, (v, s) in per.items():
            sums[k] = (sums[k][0] + v, sums[k][1] + s)
    print("mean: " + "  ".join(f"k={k} {v / args.prompts:.2f} a verify, {s / args.prompts:.2f} a step"
                               for k, (v, s) in sums.items()))
    passages = corpus_passages(tokenize, 200)
    accs = [copy_accuracy(model, passages[j], dev) for j in range(0, len(passages), max(len(passages) // 4, 1))[:4]]
    print(f"a passage's second copy predicted (teacher-forced top-1, {len(accs)} passages of 200 tokens): "
          f"{100 * sum(accs) / len(accs):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
