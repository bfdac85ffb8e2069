"""What greedy n-gram speculation would accept on a model and a workload, without a server: transformers' greedy
output for each prompt, replayed through the router's proposer (runtime/router/ngram.py) as spec=ngram verifies it
(each verify keeps the proposal's longest prefix that equals the greedy tokens, plus one token of the model's own).
Prints the tokens a verify yields per prompt and their mean, per k: the figure a served run's
`Spec decode tokens per verify step` shows for the same model and prompts (chained verifies and backoffs aside).

Also how much of a passage's second copy the model predicts when the passage is given twice (teacher-forced
top-1), the copying that n-gram proposals live on. --blocks keeps some of the model's decoder blocks, as
scripts/cut_gguf.py cuts a GGUF (gpu_run.sh's SmolLM2 cuts), to see what a cut still copies.

    python scripts/spec_acceptance.py --model .models/smollm2-135m [--blocks 0-2,7,8] [--prompts 4] [--k 4 8]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tokens_per_verify(prompt: Sequence[int], output: Sequence[int], k: int, ngram_min: int = 1,
                      ngram_max: int = 3) -> float:
    """Output tokens per verify step when greedy `output` is produced by n-gram speculation over `prompt`."""
    from llaunch.runtime.router.ngram import propose

    history, done, verifies = list(prompt), 0, 0
    while done < len(output):
        proposal = propose(history, k, ngram_min, ngram_max)
        kept = 0
        while kept < len(proposal) and done + kept < len(output) and proposal[kept] == output[done + kept]:
            kept += 1
        step = min(kept + 1, len(output) - done)  # the kept tokens and the model's own after them
        history += output[done:done + step]
        done += step
        verifies += 1
    return len(output) / max(verifies, 1)


def keep_blocks(model, blocks: list[int]) -> None:
    """Keep only these decoder blocks (renumbered), as cut_gguf.py cuts a checkpoint."""
    import torch

    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([layers[i] for i in blocks])
    for j, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = j
    model.config.num_hidden_layers = len(blocks)


def copy_accuracy(model, passage: list[int]) -> float:
    """Top-1 agreement with the passage's second copy, given the passage twice (teacher-forced)."""
    import torch

    ids = torch.tensor([passage + passage])
    with torch.no_grad():
        pred = model(ids).logits[0].argmax(-1)
    n = len(passage)
    return (pred[n:-1] == ids[0, n + 1:]).float().mean().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face model folder (scripts/prepare_models.py writes one)")
    ap.add_argument("--blocks", default=None, help="decoder blocks to keep, as cut_gguf.py --blocks (default: all)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8], help="tokens proposed per verify")
    ap.add_argument("--seed", type=int, default=24, help="bench_spec.sh's c1 seed")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from bench_spec import corpus_passages, text_copy_prompts, tokenizer_of
    from cut_gguf import parse_blocks

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    if args.blocks:
        keep_blocks(model, parse_blocks(args.blocks, model.config.num_hidden_layers))
    tokenize = tokenizer_of(args.model)
    sums = {k: 0.0 for k in args.k}
    for i, prompt in enumerate(text_copy_prompts(args.prompts, args.input_len, tokenize, args.seed)):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=args.output_len, do_sample=False,
                                 min_new_tokens=args.output_len)[0, len(prompt):].tolist()
        per = {k: tokens_per_verify(prompt, out, k) for k in args.k}
        print(f"prompt {i}: " + "  ".join(f"k={k} {v:.2f}" for k, v in per.items()), flush=True)
        for k, v in per.items():
            sums[k] += v
    print("tokens a verify, mean: " + "  ".join(f"k={k} {v / args.prompts:.2f}" for k, v in sums.items()))
    passages = corpus_passages(tokenize, 200)
    accs = [copy_accuracy(model, passages[j]) for j in range(0, len(passages), max(len(passages) // 4, 1))[:4]]
    print(f"a passage's second copy predicted (teacher-forced top-1, {len(accs)} passages of 200 tokens): "
          f"{100 * sum(accs) / len(accs):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
