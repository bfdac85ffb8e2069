#!/usr/bin/env bash
# The device calls the open GPU work needs, one per name, each planned to end inside one call's 600 s from a fresh
# machine (install included); what a call carries is a folder of ignored files, and 64 MiB in all with the tree.
#
#   here, once:  bash scripts/gpu_run.sh prepare     (.whl, .whl-serve, .gpu, .gpu-spec: all ignored, so a fresh
#                checkout makes them again)
#   here, before each call:  bash scripts/gpu_run.sh stamp
#   there:       bash scripts/gpu_calls.sh NAME     (results under $OUT)
#
# NAME      carry                                        what it runs
# suite     .whl .gpu                                    the GPU suite (must be green for kernel changes), then the fp8
#                                                        step's layer kinds alone and launch shapes (fp8_layers)
# spectune  .whl                                         #38: SmolLM2's decode and verify steps under
#                                                        kernels.row_invariant, one GEMV launch shape varied at a time
# changed   .whl .gpu                                    the GPU tests of what changed since the last green suite, then
#                                                        fp8_layers' sweep (when a whole suite does not fit)
# fp8words  .whl                                         #37's fp8 decode step with kernels.fp8_words against without
#                                                        (per layer kind, and each kind on the word kernel's shapes)
# moe       .whl-serve .gpu                              #40: the qwen3-30b-a3b decode step per launch shape of its
#                                                        one-row layers on the tensor cores, then single served with
#                                                        the winners (MoE kernels under PDL as served now)
# kv8       .whl-serve .gpu                              #37: c256 with bf16 KV against fp8 KV, and fp8 weights with fp8
#                                                        KV, Qwen2-7B shape (at 9d253e7 fp8 KV 0.97x; since 1d98c5b
#                                                        its store is in the rotary kernel, since 6b8c5be decode
#                                                        attention multiplies the stored e4m3 values in fp16)
# kvlong    .whl-serve .gpu                              #37: KV beyond bf16's room: kv256 (256 x 4,096 + 2,048 out),
#                                                        long256 (256 x 8,192 + 256 out)
# kvprof    .whl-serve                                   #37 long256: its mixed step by kernel, bf16 KV vs e4m3
# spec      .whl-serve .gpu-spec                         #38: the served SmolLM2 shape's batch-1 decode and verify
#                                                        steps, their kernels by device time and the runner's host
#                                                        side, then n-gram speculation on SmolLM2 cut to 18 blocks (a
#                                                        model that copies), text copies: none / ngram / k8,
#                                                        c1 and c64, with the step trace
# fp8       .whl .gpu                                    #37 in one call: the fp8 tests mended since the last suite,
#                                                        swap AB (kernels.fp8_swap_ab) vs the built-in GEMVs, kv8's
#                                                        c256 bf16 KV vs fp8 KV
# fp8mixed  .whl                                         #37 c256 (fp8 1.25x bf16, 1.4x wanted): a c256-like mixed step
#                                                        (218 decode rows, 2 x 896 prompt tokens) and a 160-row decode
#                                                        step by kernel, bf16 and fp8 as served, then fp8 with the MLP
#                                                        unfused and the epilogue's GEMM at every size (as 6f85a72)
# h200single .whl .gpu                                   #37 single on an H200: the int8 GPU tests, bf16 / fp8 + the int8
#                                                        head / weight-only int8 served, single
# int8w     .whl .gpu                                    model.quantization=int8: its GPU tests, bf16 / int8 / int8 + the
#                                                        int8 head served, single and c64
# fp8tune   .whl-serve .gpu (TESTS: .whl .gpu)           #37 single: GPU tests where TESTS names them, fp8_layers'
#                                                        sweep, then bf16 / fp8 + e4m3 head / fp8 at the sweep's
#                                                        winners served
# fp8head   .whl .gpu                                    #37 single: the LM head in e4m3 too (model.fp8_lm_head), its
#                                                        step, its GPU tests, bf16 vs fp8 with it served
# int8head  .whl .gpu                                    #37 single: the LM head in int8 (model.int8_lm_head): its GPU
#                                                        tests, the head alone, the step, bf16 / fp8 / fp8 + it served
# fp8single .whl-serve .gpu (TESTS: .whl .gpu)             #37: single stream, bf16 / fp8 (kernels.fp8_words, the default
#                                                        since 2026-12-05) / fp8 with float32 products
#                                                        (WORDS="kernels.gemv_shapes=..." the word kernel's shapes)
# steps1    .whl-serve                                   where a batch-1 step's device time goes, kernel by kernel: the
#                                                        Qwen2-7B shape bf16 vs fp8 (#37 single: 1.50x on an H100, 1.6x
#                                                        wanted) and Qwen3-30B-A3B (#40: 53% of its bound, 60% wanted),
#                                                        then the fp8 GEMVs per layer kind (TB/s)
# final37   .whl-serve .gpu                              #37's figures of record (name kind nvidia-h200): single and
#                                                        c256 of bf16, fp8 weights and fp8 KV, three runs each
# fp8c256   .whl-serve .gpu                              #37 c256: bf16 vs fp8 weights served, step trace, then fp8mixed
# fp8act    .whl-serve .gpu                              #37: the fp8 GEMVs with x's absmax vs a static scale vs none
# moetune   .whl-serve                                   #40: Mixtral-8x7B's MoE launches per step size (tune_moe.py;
#                                                        kernels/moe_launches.py holds Qwen3-30B-A3B's alone), then
#                                                        the kernels.moe_shapes line to store there
# draft     .whl-serve .gpu-spec                         #38 spec=draft: a draft distilled from the spec model
#                                                        (distill_draft.py), its acceptance, none / draft served, c1
# h200figs  .whl-serve .gpu                              #37 single bf16 / fp8 + int8 head, #40 MoE single, H200
# specdraft .whl-serve .gpu-spec                          #38: spec's GPU tests on the spec cut, then draft
# specserve .whl-serve .gpu-spec                         #38: spec's servers alone (none / spec / k8, c1 and c64);
#                                                        VARIANTS="none k8 k8a k16": how long proposals may be
# (.gpu without .gpu-spec: gpu_run.sh prepare writes the spec cut apart, 51 MB as xz, for the spec call alone.)
# A session's 1,800 device seconds hold about three calls (each ~40-90 s of start and transfers beside its run):
# suite first whenever kernels changed since its last green run, then by the issues' order (fp8, speculation, MoE).
# A machine stays warm 30 s after a call: the next call within that skips the start (2026-12-05: three calls in a row).
set -u
NAME=${1:?"which call: suite, changed, kvprof, h200single, draft, int8w, spectune, steps1, fp8head, int8head, fp8tune, final37, specserve, fp8, fp8act, fp8mixed, fp8words, fp8single, fp8c256, moe, moetune, kv8, kvlong, spec"}
# The device tool brings back 8 files of $OUT: the steps write under a work folder, console included, and the
# call ends by packing it into $OUT/results.tar.xz (scripts/pack_results.py; here: tar xJf .../results.tar.xz)
RESULTS=${OUT:-/tmp/llaunch-gpu}
OUT=/tmp/llaunch-gpu-work/$NAME
rm -rf "$OUT"; mkdir -p "$OUT" "$RESULTS"
export OUT
exec > >(tee -a "$OUT/console.log") 2>&1
trap 'python3 scripts/pack_results.py "$OUT" "$RESULTS/results.tar.xz"' EXIT
T0=$(date +%s)
BUDGET=${BUDGET:-555}  # seconds of the call's 600 this script may use (the start, the packing and the transfers are outside it)
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
# run an optional step only when it has `need` seconds left, under a timeout of what is left (less RESERVE seconds
# kept for the steps after it)
optional() {  # need command...
  local need=$1; shift
  local rest; rest=$(( $(left) - ${RESERVE:-0} ))
  if [ "$rest" -lt "$need" ]; then echo "[skipped: $rest s left, $need needed] $*"; return 0; fi
  timeout $(( rest - 10 )) "$@"
}
ri_sweep() {  # #38: SmolLM2's decode and verify steps under kernels.row_invariant (bench_steps --verify, dummy
  # weights), one layer kind's GEMV launch shape varied at a time: a verify row runs the decode row's programs, so
  # the rows multiply the programs. 0eafbd5, H100: built in decode 0.330 ms, verify k = 1-4 0.391-0.623; the LM head
  # at 8/256/4 0.322, 0.363-0.538 (the row grid's head shape since), no other kind's shape gained alone. Built in for
  # K = 576 besides: 2 rows x 1,024 columns a program, gate|up 8/256/4, down_proj 2/2048/4
  local h=49152x576 q=960x576 o=576x576 gu=1536x576:gated d=576x1536 cand
  for cand in "" $h=2/1024/4 $h=16/256/4 $h=8/128/4 $q=4/512/4 $q=8/256/4 $o=4/512/4 $o=8/256/4 $gu=4/512/4 \
      $d=4/512/4 $d=8/256/4; do
    echo "== row_invariant, gemv_shapes: ${cand:-built-in}"
    (cd scripts && optional 20 timeout 45 python3 bench_steps.py --verify --shape smollm2-spec --set row_invariant=true \
      ${cand:+--set gemv_shapes=$cand}) | grep -e '"decode"' -e '"verify"'
  done | tee -a "$OUT/ri_sweep.txt"
}
install() {  # from whichever wheelhouse the call carried
  WHEELS=$([ -d .whl ] && echo .whl || echo .whl-serve) bash scripts/gpu_run.sh install || exit 1
  export PYTHONPATH=/tmp/site
}
fp8_activations() {  # the fp8 decode step's GEMVs per layer kind: x's absmax (as served), a static scale, none
  for a in dynamic static none; do
    # one candidate (the built-in qkv shape) for the step time beside the per-kind figures, not the register grid
    (cd scripts && optional 60 python3 bench_decode_shapes.py --fp8 --per-kind --activations $a \
      --candidates 4608x3584:fp8=8/512/4) | grep -v Warning \
      | tee -a "$OUT/fp8_activations.jsonl"
  done
}
# #37: the fp8 decode step with the register kernel's weights as words (kernels.fp8_words) against without, per
# layer kind, and every kind on the register kernel at a few shapes (gate‖up and down_proj leave the tensor cores;
# picked from their sm90 builds: 3.7-4.1 instructions a weight a thread in the loop, ~5 at the built-in 8/512/4,
# and 8.8 there without words)
WORD_CANDIDATES="4608x3584:fp8=16/1024/4 4608x3584:fp8=32/1024/8 4608x3584:fp8=8/2048/4 3584x3584:fp8=16/1024/4 \
3584x3584:fp8=32/1024/8 3584x3584:fp8=8/1024/4 18944x3584:gated:fp8=8/1024/4 18944x3584:gated:fp8=16/1024/8 \
18944x3584:gated:fp8=8/2048/8 3584x18944:fp8=16/1024/4 3584x18944:fp8=32/1024/8 3584x18944:fp8=16/2048/8"
# Qwen2-7B's LM head in e4m3 (152,064 x 3,584): the built-in register shape, wider programs, the tensor cores
HEAD_CANDIDATES="152064x3584:fp8=8/512/4 152064x3584:fp8=16/512/8 152064x3584:fp8=8/1024/4 \
152064x3584:fp8=32/256/4/3 152064x3584:fp8=64/256/4/3"
fp8_words() {
  (cd scripts && optional 40 python3 bench_decode_shapes.py --fp8 --no-words --per-kind \
    --candidates 4608x3584:fp8=8/512/4) | grep -v Warning | tee -a "$OUT/fp8_words.jsonl"
  (cd scripts && optional 60 python3 bench_decode_shapes.py --fp8 --per-kind --candidates "$WORD_CANDIDATES") \
    | grep -v Warning | tee -a "$OUT/fp8_words.jsonl"
}
# #37 c256: a c256-like mixed step by kernel as served now (kernels.fp8_fused_mlp and fp8_fused_norm, per-tensor
# GEMMs; with fp8_fused_norm=false it took 31.75 ms against 31.48 at b6f9417, H100), then the gated quantize alone
gated_quant_bench() {  # the gated quantize alone (101 µs a layer at 2,010 rows at 1aa8d7a, H100): as served, dividing,
  # without the channel scales
  (cd scripts && optional 25 timeout 90 python3 bench_gated_quant.py) | grep -v Warning | tee "$OUT/gated_quant.jsonl"
}
fp8_mixed() {
  local mixed="--rows 160 --mixed-rows 218 --mixed-prompts 2 --chunk-len 896 --top 16"
  (cd scripts && RESERVE=30 optional 60 timeout 240 python3 profile_kernels.py $mixed) \
    | grep -v -e Warning -e USDT | tee "$OUT/fp8_mixed_profile.txt"
  gated_quant_bench
  # o_proj's and down_proj's scales through their epilogue kernel again (kernels.fp8_norm_epilogue's A/B)
  (cd scripts && optional 40 timeout 120 python3 profile_kernels.py $mixed --formats fp8 \
    --set fp8_norm_epilogue=false) | grep -v -e Warning -e USDT | tee "$OUT/fp8_mixed_epilogue_kernel.txt"
}
# #37 single (fp8 1.385x bf16 served on an H200, 1.6x wanted: ~2.30 ms a step against 2.65): the fp8 step as served
# (words) with each layer kind's GEMVs chained alone (TB/s; at c5b6b5d, without words: qkv 1.72, o_proj 1.63, gate|up
# 3.52, down 2.71), then the register kernel's shapes around the built-in ones, K split over 2 programs a tile
# (SPLIT with STAGES 0). Programs an SM holds by their sm90 registers (words, bf16 x, built as launched: the strides
# specialized as multiples of 16, so the weights load 128 bits at a time; until 2026-12-07 these counts came from
# builds without, 40-146 registers, and 7 of the 15 candidates then chosen took more than one wave):
# 32/1024/8 210 registers, 1; 16/1024/8 100, 2; 16/512/8 70, 3; 8/1024/4 96, 5; 8/512/4 64 (split 2: 59), 8;
# 4/1024/4 64, 8; 4/512/4 48, 10; 8/256/4 split 2 40, 12; gated gate|up as words: 8/256/4 62, 8; 4/512/4 59, 8;
# 8/512/4 94, 5. Built in: qkv 8/512/4 (576 programs of 1,056 places), o_proj 16/512/8 (224 of 396), down_proj
# 32/1024/8 (112 on 132 SMs: 20 idle), gate|up 8/512/4 as words since 2026-12-07 (H100: step 3.222 ms against
# 3.316 on the tensor cores at 32/256/4/3, the candidate here; the ungated winners there within 0.3%). Each ungated
# candidate fits one wave
LAYER_CANDIDATES="3584x18944:fp8=16/1024/8 3584x18944:fp8=8/1024/4 3584x18944:fp8=4/1024/4 3584x18944:fp8=8/512/4 \
3584x18944:fp8=8/512/4/0/2 3584x18944:fp8=8/256/4/0/2 3584x3584:fp8=8/512/4 3584x3584:fp8=8/512/4/0/2 \
3584x3584:fp8=8/256/4/0/2 3584x3584:fp8=4/1024/4 3584x3584:fp8=8/1024/4 4608x3584:fp8=8/256/4/0/2 \
4608x3584:fp8=8/1024/4 4608x3584:fp8=16/512/8 4608x3584:fp8=4/512/4 \
18944x3584:gated:fp8=32/256/4/3 18944x3584:gated:fp8=8/256/4 18944x3584:gated:fp8=4/512/4"
fp8_layers() {
  (cd scripts && optional 70 timeout 180 python3 bench_decode_shapes.py --fp8 --per-kind \
    --candidates "$LAYER_CANDIDATES") \
    | grep -v Warning | tee -a "$OUT/fp8_layers.jsonl"
}
# the fp8 layers' tensor-core shapes (qkv, o_proj with K split to fill the SMs; gate‖up; down_proj as built in)
SWAP_CANDIDATES="4608x3584:fp8=64/256/4/3/2 4608x3584:fp8=64/128/4/4/2 3584x3584:fp8=64/256/4/3/4 \
3584x3584:fp8=64/128/4/4/4 18944x3584:gated:fp8=64/256/4/3 18944x3584:gated:fp8=64/128/4/4 3584x18944:fp8=64/256/4/3/4"
QWEN7B="model=qwen2-7b model.load_format=dummy router.max_running_requests=256 server.http_workers=4"

case $NAME in
  suite)
    # the tests' clients (openai, anthropic, ...) are in .whl alone: without it collection fails after the install
    [ -d .whl ] || { echo "suite: carry .whl (the full wheelhouse), not .whl-serve"; exit 2; }
    install
    bash scripts/gpu_run.sh tests  # a failure is reported there; the measurements after it still run
    fp8_layers ;;
  spectune)
    install
    ri_sweep ;;
  changed)  # when a whole suite does not fit the device time left: the GPU tests of what changed since the last green
    # suite (b54cba2 on an H100; since: kernels/int8_rows.py, prefill attention over an fp8 cache, and spec=draft's
    # proposals read on the device by the verify steps, new at 2026-12-07), then fp8_layers' sweep (the fp8 step's
    # layer kinds as built in and at other launch shapes, TB/s each)
    [ -d .whl ] || { echo "changed: carry .whl (the full wheelhouse), not .whl-serve"; exit 2; }
    install
    TESTS="tests/kernels/test_kernel_int8_rows.py tests/kernels/test_kernel_prefill_attention.py tests/gpu/test_fp8.py
      tests/gpu/test_smollm2_agreement.py tests/gpu/test_mixed_graphs_gpu.py tests/gpu/test_spec_decode_gpu.py
      tests/gpu/test_verify_graphs_gpu.py" \
      bash scripts/gpu_run.sh tests
    fp8_layers ;;
  fp8mixed)
    install
    fp8_mixed ;;
  fp8act)
    install
    fp8_activations ;;
  fp8words)
    install
    fp8_words ;;
  fp8)  # #37 in one call: the tests mended since the last suite, swap AB against the built-in kernels, then kv8's c256
    install
    # and the ones that serve 2-16 rows through kernels.skinny_rows, on by default since 8e49252
    TESTS="tests/kernels/test_kernel_fp8_rows.py tests/kernels/test_kernel_gemv.py tests/kernels/test_kernel_skinny_gemm.py
      tests/gpu/test_spec_decode_gpu.py tests/gpu/test_verify_graphs_gpu.py tests/gpu/test_mixed_graphs_gpu.py" \
      optional 60 bash scripts/gpu_run.sh tests
    # swap AB before the c256 servers: with less than the whole BUDGET they get what it leaves (a reserve for them
    # skipped it at BUDGET=320 on 2026-12-05)
    (cd scripts && optional 60 timeout 200 python3 bench_decode_shapes.py --fp8 --swap-ab --candidates "$SWAP_CANDIDATES") \
      | grep -v Warning | tee "$OUT/fp8_swap_ab.jsonl"
    SERVE="$QWEN7B" CASES=c256 VARIANTS="bf16kv:|fp8kv:cache.kv_dtype=fp8_e4m3" optional 200 bash scripts/gpu_run.sh cases ;;
  moe)
    install
    # the bound #40 is held against (active weight bytes a token / copy bandwidth) on this machine, not another's
    python3 scripts/bench_copy.py | tee "$OUT/copy.json"
    # the sweep stops where the two servers after it (~120 s each: 61 GB of dummy weights, 3 runs) would not fit; its
    # one-row dense layers on the register GEMV at other launch shapes (on the tensor cores, --skinny, 24 shapes lost
    # 3.7-21% at d50ce77 on an H100; the H200's 369.7 tok/s ran o_proj at 2/1024/4 and the router at 4/2048/4)
    (cd scripts && RESERVE=250 optional 120 python3 bench_decode_shapes.py --shape qwen3-30b-a3b --layers 48 \
      ${MOE_SWEEP:-}) \
      | grep -v Warning | tee "$OUT/moe_shapes.jsonl"
    serve=$(python3 -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(next((r.get("serve", "") for r in rows if r.get("kind") == "summary"), ""))' "$OUT/moe_shapes.jsonl")
    echo "winners: ${serve:-none (the built-in launches stay)}"
    SERVE="model=qwen3-30b-a3b model.load_format=dummy server.http_workers=4" CASES=single \
      VARIANTS="built_in:|winners:$serve" optional 240 bash scripts/gpu_run.sh cases ;;
  moetune)
    install
    optional 200 python3 scripts/tune_moe.py --experts 8 --inter 14336 --hidden 4096 --top-k 2 --copies 2 \
      --budget-s $(( $(left) - 60 )) --out "$OUT/moe_shapes_mixtral.txt" | tee "$OUT/tune_moe_mixtral.jsonl" ;;
  kv8)
    install
    # with the step trace: the decode and mixed steps' device time with either cache (the KV reads are most of c256's
    # growth). fp8 weights with fp8 KV too: KV8_VARIANTS="...|fp8all:model.quantization=fp8 cache.kv_dtype=fp8_e4m3"
    # (a third server does not fit beside two of three runs each; 8,340 at a70e21d)
    SERVE="$QWEN7B" CASES=c256 TRACE=1 VARIANTS=${KV8_VARIANTS:-"bf16kv:|fp8kv:cache.kv_dtype=fp8_e4m3"} \
      optional 300 bash scripts/gpu_run.sh cases ;;
  fp8head)  # #37 single with the LM head in e4m3 too (model.fp8_lm_head): the decode step with and without it (the
    # head's shape at a few launch shapes), its GPU tests (SmolLM2's agreement with and without, the head's logits
    # against the reference at the built-in shape and at 64/256/4/3), then bf16 against fp8 with the head served
    # (built in, and at 64/256/4/3), three runs each (at fe41bbd, H200: 254 s of the call for bf16 and the first)
    install
    (cd scripts && optional 40 python3 bench_decode_shapes.py --fp8 --candidates 4608x3584:fp8=8/512/4) \
      | grep -v Warning | tee -a "$OUT/fp8head_step.jsonl"
    (cd scripts && optional 60 python3 bench_decode_shapes.py --fp8 --fp8-lm-head --candidates "$HEAD_CANDIDATES") \
      | grep -v Warning | tee -a "$OUT/fp8head_step.jsonl"
    TESTS="tests/gpu/test_fp8.py -k head" optional 60 bash scripts/gpu_run.sh tests
    # (a gemv_shapes value holds '=': quoted for Hydra; the head's tensor-core shape won 2.678 vs 2.787 ms on the H200)
    SERVE="$QWEN7B" CASES=single VARIANTS="bf16:|fp8head:model.quantization=fp8 model.fp8_lm_head=true|fp8head64:\
model.quantization=fp8 model.fp8_lm_head=true kernels.gemv_shapes='152064x3584:fp8=64/256/4/3'" \
      optional 280 bash scripts/gpu_run.sh cases ;;
  int8head)  # #37 single: the LM head's weights in int8 (model.int8_lm_head; kernels/int8_rows.py, new at 2026-12-07,
    # never run on a GPU before): its GPU tests, the head alone by rows and storage (bench_lm_head.py, its one-row path at
    # other launch shapes), the fp8 decode step with each head, then bf16 / fp8 / fp8 with the int8 head served
    [ -d .whl ] || { echo "int8head: carry .whl (its GPU tests need the full wheelhouse)"; exit 2; }
    install
    TESTS="tests/kernels/test_kernel_int8_rows.py tests/gpu/test_int8_weights_gpu.py tests/gpu/test_fp8.py -k int8" \
      optional 90 bash scripts/gpu_run.sh tests
    # the head alone by rows; the one-row path around its built-in 32/256/8 (16/512/8 until 2026-12-07: 0.200 ms vs
    # 0.191, H100); past 16 rows the tensor-core tiles (until 2026-12-07 64-row tiles of x as the MMA's first operand,
    # 64/128/64/8/3: 0.335 / 1.198 ms at 64 / 256 rows vs bf16's 0.396 / 0.460; since, all rows in one tile with the
    # weights first, from registers)
    (cd scripts && optional 60 timeout 150 python3 bench_lm_head.py --rows 1 16 64 256 --one-row 16/512/8 64/128/8 \
      32/512/8 --tiles 64/128/64/8/3 128/128/64/8/3/swap 256/64/64/4/3/swap 256/128/128/8/2/swap --tile-rows 64 256) \
      | grep -v Warning | tee -a "$OUT/lm_head.jsonl"
    for head in "" --int8-lm-head --fp8-lm-head; do
      (cd scripts && optional 30 python3 bench_decode_shapes.py --fp8 $head --candidates 4608x3584:fp8=8/512/4) \
        | grep -v Warning | tee -a "$OUT/int8head_step.jsonl"
    done
    SERVE="$QWEN7B" CASES=single VARIANTS="bf16:|fp8:model.quantization=fp8|fp8int8head:model.quantization=fp8 \
model.int8_lm_head=true" optional 250 bash scripts/gpu_run.sh cases ;;
  h200single)  # #37 single on an H200 (1.6x bf16 wanted; there fp8 was 1.385x at fe41bbd, before the word kernels and the
    # int8 head): the int8 GPU tests (the quantizing helper shared by the int8 layers and head since 87d6b21), then
    # bf16 / fp8 with the int8 head / weight-only int8 served, single, three runs each
    [ -d .whl ] || { echo "h200single: carry .whl (its GPU tests need the full wheelhouse)"; exit 2; }
    install
    TESTS="tests/kernels/test_kernel_int8_rows.py tests/gpu/test_int8_weights_gpu.py tests/gpu/test_fp8.py -k int8" \
      optional 90 bash scripts/gpu_run.sh tests
    SERVE="$QWEN7B" CASES=single VARIANTS="bf16:|fp8int8head:model.quantization=fp8 model.int8_lm_head=true|\
int8:model.quantization=int8" optional 200 bash scripts/gpu_run.sh cases ;;
  h200figs)  # the single-stream figures only an H200 gives, lean (no tests, no sweep): #37 bf16 / fp8 with the int8
    # head on Qwen2-7B's shape, then #40 Qwen3-30B-A3B with its MoE kernels under PDL as served (369.7 tok/s at
    # c68a0aa ran without), beside this machine's copy bandwidth
    install
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || echo "h200figs: not an H200 (figures for the record only)"
    python3 scripts/bench_copy.py | tee "$OUT/copy.json"
    SERVE="$QWEN7B" CASES=single VARIANTS="bf16:|fp8int8head:model.quantization=fp8 model.int8_lm_head=true" \
      RESERVE=150 optional 150 bash scripts/gpu_run.sh cases
    SERVE="model=qwen3-30b-a3b model.load_format=dummy server.http_workers=4" CASES=single VARIANTS="moe:" \
      optional 120 bash scripts/gpu_run.sh cases ;;
  int8w)  # model.quantization=int8 (weight-only int8 linears, new at 2026-12-07): bf16 against int8 weights and int8
    # weights with the int8 head, single and c64 (its tensor-core path converts the weights as it multiplies: under load
    # no faster than bf16, to be seen); its GPU tests first
    [ -d .whl ] || { echo "int8w: carry .whl (its GPU tests need the full wheelhouse)"; exit 2; }
    install
    TESTS="tests/kernels/test_kernel_int8_rows.py tests/gpu/test_int8_weights_gpu.py" optional 60 bash scripts/gpu_run.sh tests
    SERVE="$QWEN7B" CASES="single c64" VARIANTS="bf16:|int8:model.quantization=int8|int8head:model.quantization=int8 \
model.int8_lm_head=true" optional 300 bash scripts/gpu_run.sh cases ;;
  fp8tune)  # #37 single: fp8_layers' sweep (each kind's best launch shape kept, then combined), then bf16, fp8 with the
    # e4m3 head (model.fp8_lm_head) at the sweep's shapes, and fp8 at them without the head served, three runs each
    # (~85 s a server; the third where time is left). TESTS: GPU tests first (carry .whl instead of .whl-serve)
    install
    if [ -n "${TESTS:-}" ]; then optional 100 timeout 140 bash scripts/gpu_run.sh tests; fi
    fp8_layers
    TUNED=$(python3 -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(next((r["serve"].replace("\"", "\x27") for r in rows if r.get("kind") == "summary" and "serve" in r), ""))' \
      "$OUT/fp8_layers.jsonl")
    echo "the sweep's shapes: ${TUNED:-none better than built in}"
    SERVE="$QWEN7B" CASES=single VARIANTS="bf16:|fp8head:model.quantization=fp8 model.fp8_lm_head=true ${TUNED:-}|\
fp8${TUNED:+tuned}:model.quantization=fp8 ${TUNED:-}" optional 260 bash scripts/gpu_run.sh cases ;;
  fp8single)  # #37's single stream: bf16, fp8 as built in (its GEMVs as words; WORDS: kernels overrides, e.g. the
    # fp8words call's winners as kernels.gemv_shapes), fp8 with float32 products
    install
    # TESTS: GPU tests mended since the last suite, first (carry .whl instead of .whl-serve for them)
    if [ -n "${TESTS:-}" ]; then optional 90 bash scripts/gpu_run.sh tests; fi
    SERVE="$QWEN7B" CASES=single \
      VARIANTS="bf16:|fp8:model.quantization=fp8 ${WORDS:-}|fp8f32:model.quantization=fp8 kernels.fp8_words=false" \
      optional 200 bash scripts/gpu_run.sh cases ;;
  fp8c256)  # #37 c256: bf16 against fp8 weights as served, with the step trace, the card's clocks a run and 60 steps
    # of a fourth run by kernel (at a8657e7, H100: 1.28x; bf16's served mixed step 51.73 ms against profile_kernels'
    # 41.49, fp8's 38.26 against 37.60: the clock or the software?); then the mixed step's kernels when time is left
    install
    SERVE="$QWEN7B" CASES=c256 TRACE=1 PROFILE_STEPS=${PROFILE_STEPS:-60} VARIANTS="bf16:|fp8:model.quantization=fp8" \
      optional 300 bash scripts/gpu_run.sh cases
    fp8_mixed ;;
  steps1)  # no servers: each profile builds its model with dummy weights (~60 s the 7B pair, ~90 s the MoE's 61 GB)
    install
    (cd scripts && optional 120 python3 profile_kernels.py --rows 1 --chunk-len 0 --top 30 \
      --formats bf16 fp8 fp8int8head) \
      | grep -v Warning | tee "$OUT/step1_qwen2_7b.txt"
    (cd scripts && optional 150 python3 profile_kernels.py --shape qwen3-30b-a3b --layers 48 --formats bf16 --rows 1 \
      --chunk-len 0 --top 24) | grep -v Warning | tee "$OUT/step1_qwen3_30b_a3b.txt"
    fp8_layers ;;
  final37)  # #37 on an H200, bf16 in the same call: fp8 weights single >= 1.6x and c256 >= 1.4x, fp8 KV c256 >= 1.0x
    # (no trace or profile: ~20 s of install, then ~170 s a server, 120 of them for fp8 weights)
    install
    # (CASES=c256 where int8head ran single in the same session: its servers are bf16 / fp8 / fp8 + the int8 head)
    SERVE="$QWEN7B" CASES=${CASES:-"single c256"} \
      VARIANTS="bf16:|fp8:model.quantization=fp8|fp8kv:cache.kv_dtype=fp8_e4m3" optional 300 bash scripts/gpu_run.sh cases
    gated_quant_bench ;;
  kvlong)
    install
    # kv256 first (decode-bound: what twice the KV room buys), then long256 (prefill-bound: at aaaa21f on an H100
    # fp8 KV 859 tok/s against bf16 KV's 953, TTFT 36.5 s against 32.6)
    # On an H200 kv256 fits bf16's room: CASES=kv256x6k there (256 x 6,144 + 2,048), one call a variant as below
    # (kv256's three runs a variant do not fit one call: CASES=kv256 REPEATS=3 VARIANTS=bf16kv: in one call, then
    # VARIANTS=fp8kv:cache.kv_dtype=fp8_e4m3 in the next on the same warm machine)
    SERVE="$QWEN7B" CASES="${CASES:-kv256 long256}" REPEATS=${REPEATS:-1} \
      VARIANTS="${VARIANTS:-bf16kv:|fp8kv:cache.kv_dtype=fp8_e4m3}" optional 300 bash scripts/gpu_run.sh cases
    gated_quant_bench ;;
  kvprof)  # #37 long256 (fp8 KV 0.96x bf16 KV at d50ce77, H100, prefill setting the pace): its mixed step by kernel,
    # bf16 KV against e4m3 (scales 1.0): 64 decode rows at ~7k tokens beside a 1,024-token chunk after 7,168 cached
    # (and after 3,072), graphs, then where the e4m3 step's extra time goes
    install
    for kv in auto fp8_e4m3; do
      for prefix in 7168 3072; do
        (cd scripts && optional 60 timeout 150 python3 profile_kernels.py --formats bf16 --kv $kv --rows 1 \
          --mixed-rows 64 --context 8000 --chunk-len 1024 --prefix $prefix --top 14) \
          | grep -v -e Warning -e USDT | tee -a "$OUT/kvprof.txt"
      done
    done ;;
  spec)
    install
    # where a served batch-1 verify step's time goes: at 9d253e7 (H100) its device time was 1.1-1.3 ms at 2-5 tokens
    # against 0.6 at one token, and its launch 0.85 ms against decode's 0.28
    (cd scripts && optional 60 timeout 120 python3 bench_steps.py --verify --shape smollm2-spec --skinny-rows 16 \
      --profile 14) | grep -v -e Warning -e USDT | tee "$OUT/verify_smollm2.txt"
    # the same steps under kernels.row_invariant (verify rows on the GEMV's row grid, as decode rows): what bf16
    # identity costs, or saves (SmolLM2's 576-wide layers: the skinny GEMM 11 µs a launch, the GEMV 4.4, profiled at aaaa21f)
    (cd scripts && optional 40 timeout 90 python3 bench_steps.py --verify --shape smollm2-spec --set row_invariant=true \
      --profile 14) | grep -v -e Warning -e USDT | tee "$OUT/verify_smollm2_row_invariant.txt"
    # and at shorter K tiles (576 columns in one 1,024-lane tile waste 44% of the lanes; the LM head's built-in 2-row
    # tiles make 24,576 programs a row)
    (cd scripts && optional 40 timeout 60 python3 bench_steps.py --verify --shape smollm2-spec --set row_invariant=true \
      --set gemv_shapes=49152x576=32/64/4,960x576=8/128/4,576x576=8/128/4,1536x576:gated=8/128/4,576x1536=8/256/4) \
      | grep -v -e Warning -e USDT | grep -e '"decode"' -e '"verify"' | tee -a "$OUT/verify_smollm2_row_invariant.txt"
    # ~85 s a server (warm-up, then c1 and c64 three times each)
    # spec_mb16 left: at 9d253e7 c64 0.95x none (the old default); k8 had one c1 run there (1.84x)
    # bfloat16 since e6bc043 (the figures before were float32's); PROFILE_STEPS: each server's kernels as served
    # none_ri / spec_ri: kernels.row_invariant=true (at aaaa21f in bf16 only 41 of 96 c1 texts of spec were none's;
    # k8 left out this time: 1.80x c1, 1.30x c64 at aaaa21f)
    TRACE=1 PROFILE_STEPS=${PROFILE_STEPS:-40} VARIANTS=${VARIANTS:-"none spec none_ri spec_ri"} optional 300 \
      bash scripts/gpu_run.sh spec ;;
  draft)  # #38 spec=draft (>= 1.5x none wanted, c1): no smaller model of SmolLM2's tokenizer is offline, and cut
    # without training its blocks agree on nothing (1.00 tokens a verify): a draft of 4 of the spec model's 18 blocks
    # distilled from it on the standard library's sources (scripts/distill_draft.py, new at 2026-12-07), what its
    # proposals keep, then none / draft k = 4 (/ k = 8) served, c1 (VARIANTS=off: not served, ~150 s in all).
    # a161135, H100: 2,000 steps in 90 s, 77.8% held-out agreement, served 3.97 / 5.83 tokens a verify yet 0.96x / 1.10x
    # none (a verify step sent every 2.09 ms, its enqueue 1.0 ms waiting for the proposals); since, the proposals stay
    # on the device and each draft step's argmax is the greedy kernel. DRAFT_BLOCKS=0,17: a draft of half the steps
    install
    TRACE=1 DRAFT_BLOCKS=${DRAFT_BLOCKS:-0,1,16,17} CASES=${CASES:-c1} VARIANTS=${VARIANTS:-"none spec k8"} \
      optional 300 bash scripts/gpu_run.sh spec ;;
  specdraft)  # #38 in one call (carry .whl-serve .gpu-spec: these tests need no client, the image has pytest; .gpu's
    # 11-block cut does not fit beside the spec cut): spec's GPU tests on the spec cut (18 blocks) since the verify
    # steps read the draft's proposals on the device, then draft
    install
    xz -dc .gpu-spec/smollm2-spec.gguf.xz > /tmp/smollm2-spec.gguf
    python3 scripts/prepare_models.py --gguf /tmp/smollm2-spec.gguf --out .models 2>&1 | tail -1
    TESTS="tests/gpu/test_spec_decode_gpu.py tests/gpu/test_verify_graphs_gpu.py tests/kernels/test_kernel_greedy.py
      tests/gpu/test_mixed_graphs_gpu.py" optional 120 bash scripts/gpu_run.sh tests
    # (100 s of distilling: the 2,000-step cap came at ~90 s on an H100; k = 8 drafted after the plan and ahead of it)
    TRACE=1 DISTILL_SECONDS=${DISTILL_SECONDS:-100} DRAFT_BLOCKS=${DRAFT_BLOCKS:-0,1,16,17} CASES=${CASES:-c1} \
      VARIANTS=${VARIANTS:-"none spec k8 k8ahead"} optional 300 bash scripts/gpu_run.sh spec ;;
  specserve)  # #38 served alone, without spec's step benches: none against n-gram proposals of k = 4 and 8, c1 and
    # c64 (~85 s a server); since d6abb0c the proposals repeat their period and spec.ngram_max is 8. bb9de56, H100:
    # c1 2.07x (k = 4) / 2.67x (k = 8), c64 1.41x / 1.44x. Texts compare only between servers that ran the same
    # CASES (the prefix cache then holds the same prefixes): a CASES=c1 k8_ri call against a c1 + c64 none_ri one
    # is not comparable (spec_text_agreement.py says so)
    install
    TRACE=1 VARIANTS=${VARIANTS:-"none spec k8"} optional 200 bash scripts/gpu_run.sh spec ;;
  *) echo "unknown call $NAME (suite, changed, spectune, steps1, final37, specserve, fp8, fp8act, fp8mixed, fp8words, fp8single, fp8c256, moe, moetune, kv8, kvlong, spec)"; exit 2 ;;
esac
echo "[$(( $(date +%s) - T0 ))s] $NAME done"
