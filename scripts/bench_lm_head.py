"""The LM head alone on a GPU, by how its weight is stored and by the step's rows: Qwen2-7B's head (152,064 x 3,584,
bfloat16 model) through dispatch.lm_head_linear as served, 16-bit (the staged GEMV at one row, the skinny GEMM at
2-16, cuBLAS beyond), int8 rows (model.int8_lm_head, kernels/int8_rows.py) and e4m3 (model.fp8_lm_head); ms a call
(eager launches back to back, median of 5 timings) and the weight bytes a second. --one-row SHAPES times the int8
head's one-row path at other launch shapes (BLOCK_N/BLOCK_K/WARPS each), --tiles SHAPES its tensor-core path at
--tile-rows (BLOCK_M/BLOCK_N/BLOCK_K/WARPS/STAGES, then /swap for the weights as the MMA's first operand; BLOCK_M
the most rows a tile takes, as launch_shape's).

    python scripts/bench_lm_head.py [--rows 1 4 16 64 256] [--one-row 4/1024/4 8/512/4]
        [--tiles 64/128/64/8/3 256/128/64/8/3/swap --tile-rows 64 256]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))


def main() -> int:
    from bench_verify_steps import per_step_ms

    from llaunch.kernels import dispatch, fp8, int8, int8_rows

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16, 64, 256])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--one-row", nargs="*", default=[], help="the int8 head's one-row launch shapes to try, N/K/WARPS")
    ap.add_argument("--tiles", nargs="*", default=[], help="its tensor-core launch shapes, M/N/K/WARPS/STAGES[/swap]")
    ap.add_argument("--tile-rows", type=int, nargs="+", default=[32, 64, 128, 256])
    args = ap.parse_args()
    device = torch.device("cuda")
    weight = (torch.randn(args.vocab, args.hidden, device=device) / args.hidden ** 0.5).to(torch.bfloat16)
    heads = {"bf16": weight, "int8": int8.quantize_rows(weight),
             "fp8": fp8.Fp8Weight(*fp8.quantize_weight(weight))}
    bytes_per_weight = {"bf16": 2, "int8": 1, "fp8": 1}
    where = dict(vocab=args.vocab, hidden=args.hidden, device=torch.cuda.get_device_name())
    for rows in args.rows:
        x = torch.randn(rows, args.hidden, device=device).to(torch.bfloat16)
        for name, head in heads.items():
            ms = per_step_ms(lambda: dispatch.lm_head_linear(x, head), args.repeats, True)
            tbps = bytes_per_weight[name] * weight.numel() / ms / 1e9
            print(json.dumps(dict(head=name, rows=rows, ms=round(ms, 4), weight_tbps=round(tbps, 3), **where)),
                  flush=True)
    x = torch.randn(1, args.hidden, device=device).to(torch.bfloat16)
    built_in = int8_rows.ONE_ROW_SHAPE
    for shape in args.one_row:
        block_n, block_k, warps = (int(v) for v in shape.split("/"))
        int8_rows.ONE_ROW_SHAPE = (1, block_n, block_k, warps, 0)
        try:
            ms = per_step_ms(lambda: dispatch.lm_head_linear(x, heads["int8"]), args.repeats, True)
        except Exception as e:  # a shape the compiler refuses is a result too
            print(json.dumps(dict(head="int8", rows=1, one_row=shape, error=str(e)[:200])), flush=True)
            continue
        finally:
            int8_rows.ONE_ROW_SHAPE = built_in
        print(json.dumps(dict(head="int8", rows=1, one_row=shape, ms=round(ms, 4),
                              weight_tbps=round(weight.numel() / ms / 1e9, 3), **where)), flush=True)
    launch_shape = int8_rows.launch_shape
    for rows in args.tile_rows if args.tiles else []:
        x = torch.randn(rows, args.hidden, device=device).to(torch.bfloat16)
        want = int8.reference_logits(x, heads["int8"])
        for shape in args.tiles:
            *dims, swap = shape.split("/") if shape.endswith("/swap") else (*shape.split("/"), "")
            block_m, block_n, block_k, warps, stages = (int(v) for v in dims)
            block_m = min(block_m, max(16, 1 << (rows - 1).bit_length())) if swap else block_m
            int8_rows.launch_shape = lambda m, layer: (block_m, block_n, block_k, warps, stages, bool(swap))
            try:
                ms = per_step_ms(lambda: dispatch.lm_head_linear(x, heads["int8"]), args.repeats, True)
                # a shape that computes wrong logits is no result (the GPU tests hold the built-in shapes)
                err = (dispatch.lm_head_linear(x, heads["int8"]) - want).abs().max().item()
            except Exception as e:
                print(json.dumps(dict(head="int8", rows=rows, tiles=shape, error=str(e)[:200])), flush=True)
                continue
            finally:
                int8_rows.launch_shape = launch_shape
            print(json.dumps(dict(head="int8", rows=rows, tiles=shape, ms=round(ms, 4), max_abs_err=err,
                                  weight_tbps=round(weight.numel() / ms / 1e9, 3), **where)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
