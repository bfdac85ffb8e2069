#!/usr/bin/env bash
# One call on an air-gapped GPU host: install the wheelhouse and llaunch, check correctness against
# transformers, serve the Qwen2-7B-shaped dummy model, run the benchmark cases of
# ../shared/BENCHMARK.md, run the transformers baseline, and print a summary.
#   scripts/build_wheelhouse.py --out .whl; scripts/prepare_tokenizers.py; cp ../shared/bench/hf_baseline.py .gpu/
#   bash scripts/gpu_run.sh [CASES...]       (CASES: correctness single c64 c256 baseline kernels gemv chain single-cublas
#                                            single-eager-prefill single-nopdl single-pdl-linear single-late smollm2-chat sweep prefix parallel smollm2 smollm2-agree tune
#                                            stash steps pd;
#                                            default: the first five)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/llaunch-gpu}
mkdir -p "$OUT"
CASES=${*:-correctness single c64 c256 baseline}
PY=python3
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

SERVE=${SERVE:-model=qwen2-7b model.load_format=dummy router.max_running_requests=256 server.http_workers=4}
MODEL_NAME=${MODEL_NAME:-qwen2-7b}
if [ -z "${SKIP_INSTALL:-}" ]; then
stamp "install"
$PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
$PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

has() { [[ " $CASES " == *" $1 "* ]]; }

if has stash; then  # the first half of the SmolLM2 GGUF, kept on this machine for the next call
  mkdir -p /tmp/stash && cp .gpu-a/smollm2.part-* /tmp/stash/ && ls -la /tmp/stash
fi
[ -f .gpu/qwen2-tokenizer.tar.xz ] && [ ! -f .models/qwen2-tokenizer/tokenizer.json ] && \
  mkdir -p .models && tar xJf .gpu/qwen2-tokenizer.tar.xz -C .models

if has tune; then  # sweep the GEMV launch shapes on this GPU; the later cases of this call run with the winners
  stamp "tune: GEMV launch shapes, chain sweep"
  timeout 450 $PY scripts/bench_gemv_chain.py --sweep --emit-shapes "$OUT/gemv-shapes.txt" --json "$OUT/gemv-chain.json" \
    2>&1 | grep -v Warning
  export LLAUNCH_GEMV_SHAPES=$(cat "$OUT/gemv-shapes.txt" 2>/dev/null)
  echo "LLAUNCH_GEMV_SHAPES=$LLAUNCH_GEMV_SHAPES"
fi

if has correctness; then
  stamp "correctness: Qwen2-7B shape, bf16, vs transformers"
  timeout 200 $PY scripts/gpu_correctness.py ${CORRECTNESS_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/correctness.jsonl"
fi

if has steps; then
  stamp "step shapes: decode, prefill and mixed forward steps"
  timeout 200 $PY scripts/bench_steps.py 2>&1 | grep -v Warning | tee "$OUT/steps.jsonl"
fi

if has gemv; then  # the batch-1 GEMV and fused rotary+KV-store kernels: tests, then timed against cuBLAS
  stamp "gemv: kernel tests and timings"
  TRITON_INTERPRET=0 timeout 200 $PY -m pytest -q -m gpu tests/kernels/test_kernel_gemv.py tests/kernels/test_kernel_rotary.py \
    tests/kernels/test_pdl.py tests/kernels/test_kernel_qkv_rotary.py tests/kernels/test_kernel_rmsnorm.py \
    tests/kernels/test_kernel_decode_attention.py \
    --confcutdir=tests/kernels -p no:cacheprovider 2>&1 | tail -3
  timeout 200 $PY scripts/bench_kernels.py --ops gemv --json "$OUT/kernels-gemv.json" 2>&1 | grep -v Warning
fi

if has chain; then  # the step's linear layers over 13 GB of distinct weights: launch shapes, PDL, cuBLAS, read ceiling
  stamp "gemv chain"
  timeout 400 $PY scripts/bench_gemv_chain.py ${CHAIN_ARGS:---sweep} --json "$OUT/gemv-chain.json" 2>&1 | grep -v Warning
fi

if has kernels; then
  stamp "kernel tests (gpu marker)"
  TRITON_INTERPRET=0 timeout 200 $PY -m pytest -q -m gpu tests/kernels --confcutdir=tests/kernels -p no:cacheprovider 2>&1 | tail -5
fi

# serve_bench TAG "LLAUNCH ARGS" CASES...: start a server, time launch → /health, run the cases, stop it
serve_bench() {
  local tag=$1 args=$2; shift 2
  stamp "serve $tag: llaunch $args"
  local start; start=$($PY -c "import time; print(time.time())")
  LLAUNCH_STEP_TRACE=${TRACE:+$OUT/trace-$tag.jsonl} llaunch $args server.port=8000 hydra.run.dir=/tmp/llaunch-run-$tag \
    >"$OUT/llaunch-$tag.log" 2>&1 &
  local lpid=$!
  $PY - "$start" "$lpid" <<'PYEOF' | tee "$OUT/startup-$tag.txt"
import os, sys, time, urllib.request
start, pid = float(sys.argv[1]), int(sys.argv[2])
while time.time() - start < 300:
    try:
        if urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=1).status == 200:
            print(f"launch -> /health 200: {time.time() - start:.1f}s")
            sys.exit(0)
    except Exception:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        break
    time.sleep(0.2)
print("launch -> /health: never")
PYEOF
  if grep -q "200:" "$OUT/startup-$tag.txt"; then
    for c in "$@"; do
      case $c in
        single) run_case $tag-single 5 512 256 1 90 ;;
        c64) run_case $tag-c64 512 1024 256 64 150 ;;
        c256) run_case $tag-c256 1024 1024 256 256 200 ;;
        chat) $PY - <<'PYEOF'
import json, urllib.request
model = json.load(urllib.request.urlopen("http://127.0.0.1:8000/v1/models"))["data"][0]["id"]
body = {"model": model, "temperature": 0, "max_tokens": 40,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}
req = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
print("chat answer:", repr(json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"]))
PYEOF
        ;;
      esac
    done
  else
    tail -30 "$OUT/llaunch-$tag.log"; for f in /tmp/llaunch-run-$tag/logs/*.log; do echo "== $f"; tail -15 "$f"; done
  fi
  kill -TERM $lpid 2>/dev/null; wait $lpid
  tail -2 "$OUT/llaunch-$tag.log"
  if [ -n "${TRACE:-}" ]; then  # where each prefill's time to first token goes, then the clients' TTFTs
    $PY scripts/step_trace_report.py "$OUT/trace-$tag.jsonl" --bins 1 --starts 2>&1 | head -${TRACE_LINES:-40}
    for f in "$OUT"/bench-$tag-*.json; do
      [ -f "$f" ] && $PY -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1].split('/')[-1], 'client TTFT ms:', [round(1000*q['ttft'],2) for q in r['requests']])" "$f"
    done
  fi
  for f in /tmp/llaunch-run-$tag/logs/*.log; do echo "== $f"; tail -30 "$f"; done > "$OUT/process-logs-$tag.txt"
}
run_case() {  # name prompts input output concurrency timeout
  stamp "bench $1"
  timeout "$6" $PY scripts/bench_serving.py --base-url http://127.0.0.1:8000 --model "$(curl -s localhost:8000/v1/models | $PY -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')" \
    --num-prompts "$2" --input-len "$3" --output-len "$4" --concurrency "$5" --warmup 2 --vocab-size ${VOCAB:-151000} \
    --client-procs $(( $5 >= ${CLIENT_PROCS:-1} ? ${CLIENT_PROCS:-1} : 1 )) \
    --result-file "$OUT/bench-$1.json" 2>&1 | grep -E "throughput|TTFT|TPOT|Successful|Failed|duration"
}

BENCH=""
for c in single c64 c256; do has $c && BENCH="$BENCH $c"; done
[ -n "$BENCH" ] && serve_bench tp1 "$SERVE" $BENCH
if has single-cublas; then  # A/B: the same single case with batch-1 linear layers left to cuBLAS
  LLAUNCH_GEMV=cublas serve_bench cublas "$SERVE" single
fi

if has single-eager-prefill; then  # A/B: the same single case with every prefill launched eagerly
  serve_bench eager-prefill "$SERVE model.prefill_graph_tokens=0" single
fi
if has single-nopdl; then  # A/B: the same single case with programmatic dependent launch off
  LLAUNCH_PDL=0 serve_bench nopdl "$SERVE" single
fi
if has single-pdl-linear; then  # A/B: PDL on the GEMVs and norms only
  LLAUNCH_PDL_KERNELS=gemv,rmsnorm serve_bench pdl-linear "$SERVE" single
fi
if has single-late; then  # A/B: PDL on every kernel, those of SINGLE_LATE triggering after their wait
  LLAUNCH_PDL_LATE=${SINGLE_LATE:-rotary,decode_attention} LLAUNCH_PDL_KERNELS=gemv,rmsnorm,rotary,decode_attention \
    serve_bench pdl-late "$SERVE" single
fi

if has parallel; then  # the tensor/data-parallel issue: c64 on tp1, tp2 and dp2 (two GPUs)
  for layout in ${LAYOUTS:-tp1 tp2 dp2}; do
    serve_bench $layout "$SERVE parallel=$layout" c64
  done
fi

if has pd; then  # prefill/decode disaggregation: master, prefill on GPU 0, decode on GPU 1 (two-GPU machine)
  if [[ " ${PD_TRANSPORTS:-zmq} " == *" nccl "* ]]; then
    stamp "NCCL pair groups: the two-GPU tests"
    timeout 300 $PY -m pytest -q -m gpu tests/unit/test_nccl_pairing.py -p no:cacheprovider --tb=short 2>&1 | tail -${NCCL_TEST_LINES:-3}
  fi
  for transport in ${PD_TRANSPORTS:-zmq}; do
    stamp "pd ($transport): master + prefill (GPU 0) + decode (GPU 1)"
    PD="mode.pd_master_port=8001 mode.kv_transport=$transport"
    llaunch $SERVE mode=pd_master server.port=8000 mode.pd_master_port=8001 hydra.run.dir=/tmp/pd-m-$transport \
      >"$OUT/pd-master-$transport.log" 2>&1 &
    M=$!
    CUDA_VISIBLE_DEVICES=0 llaunch $SERVE mode=pd_prefill server.port=8100 $PD hydra.run.dir=/tmp/pd-p-$transport \
      >"$OUT/pd-prefill-$transport.log" 2>&1 &
    P=$!
    CUDA_VISIBLE_DEVICES=1 llaunch $SERVE mode=pd_decode server.port=8200 $PD hydra.run.dir=/tmp/pd-d-$transport \
      >"$OUT/pd-decode-$transport.log" 2>&1 &
    D=$!
    if $PY scripts/wait_http.py http://127.0.0.1:8000/health 180; then
      run_case pd-$transport-c64 512 1024 256 64 180
      curl -s localhost:8000/pd/instances | tee "$OUT/pd-instances-$transport.json"; echo
    else
      tail -20 "$OUT"/pd-*-$transport.log; for f in /tmp/pd-*-$transport/logs/*.log; do echo "== $f"; tail -20 "$f"; done
    fi
    kill -TERM $M $P $D 2>/dev/null; wait $M $P $D
    for f in /tmp/pd-*-$transport/logs/*.log; do echo "== $f"; tail -20 "$f"; done > "$OUT/pd-process-logs-$transport.txt"
    grep -h -i -E "KV sender|KV receiver|stuck|NCCL WARN|broken|Traceback|Error" /tmp/pd-*-$transport/logs/*.log \
      | sort | uniq -c | sort -rn | head -15
  done
fi

# smollm2_model: join the GGUF halves (stash, .gpu-b) and convert it to .models/smollm2-135m
smollm2_model() {
  if ! ls /tmp/stash/smollm2.part-* .gpu-b/smollm2.part-* >/dev/null 2>&1; then
    echo "smollm2: the GGUF halves are missing (run 'stash' with .gpu-a first, then this with .gpu-b)"; return 1
  fi
  mkdir -p /tmp/smollm2-gguf && cat /tmp/stash/smollm2.part-* .gpu-b/smollm2.part-* \
    > /tmp/smollm2-gguf/SmolLM2-135M-Instruct.Q4_1.gguf
  $PY scripts/prepare_models.py --gguf /tmp/smollm2-gguf/SmolLM2-135M-Instruct.Q4_1.gguf --out .models 2>&1 | tail -2
}

if has smollm2-chat; then  # real weights through the one-row decode path (fused qkv + rotary, PDL): tp1 chat + single
  if smollm2_model; then
    VOCAB=49000 serve_bench smollm2-chat "model=smollm2-135m" chat single
    VOCAB=49000 LLAUNCH_PDL=0 LLAUNCH_QKV_ROTARY=0 serve_bench smollm2-chat-plain "model=smollm2-135m" chat single
  fi
fi

if has smollm2; then  # real weights: the GGUF travels in two halves (.gpu-a, .gpu-b), too big for one call
  stamp "smollm2: convert the GGUF, agreement with transformers and tp2 vs tp1"
  smollm2_model
  for dtype in bfloat16 float32; do
    timeout 300 $PY scripts/gpu_agreement.py --model-dir .models/smollm2-135m --dtype $dtype --tp 1 ${SMOL_TP:-2} \
      $([ $dtype = bfloat16 ] && echo --truth) 2>&1 \
      | grep '^{' | tee -a "$OUT/agreement.jsonl"
  done
  VOCAB=49000 serve_bench smollm2-tp1 "model=smollm2-135m" chat single
  VOCAB=49000 serve_bench smollm2-tp2 "model=smollm2-135m parallel=tp2 parallel.pad_heads=true" chat single
fi

if has smollm2-agree; then  # real weights, one GPU: agreement with transformers in bf16 (both shapes) and float32
  stamp "smollm2-agree: convert the GGUF, agreement with transformers (tp1), bf16 then float32"
  if smollm2_model; then
    timeout 300 $PY scripts/gpu_agreement.py --model-dir .models/smollm2-135m --dtype bfloat16 --tp 1 --whole --truth 2>&1 \
      | grep '^{' | tee -a "$OUT/agreement.jsonl"
    timeout 300 $PY scripts/gpu_agreement.py --model-dir .models/smollm2-135m --dtype float32 --tp 1 --whole 2>&1 \
      | grep '^{' | tee -a "$OUT/agreement.jsonl"
  fi
fi

if has sweep; then  # the H200 sweep of the sweeps issue: max_running_requests under bench=c256
  stamp "sweep"
  LLAUNCH_BENCH_TIMEOUT_S=${SWEEP_JOB_TIMEOUT_S:-110} timeout ${SWEEP_TIMEOUT_S:-330} llaunch -m bench=c256 \
      model=qwen2-7b model.load_format=dummy router.max_running_requests=32,128,256 hydra.sweep.dir=/tmp/sweep \
      >"$OUT/sweep.log" 2>&1
  echo "sweep exit: $?"; tail -5 "$OUT/sweep.log"
  llaunch-report /tmp/sweep 2>&1 | tail -12
  cp /tmp/sweep/report.md /tmp/sweep/report.png "$OUT/" 2>/dev/null
  for j in 0 1 2; do cp /tmp/sweep/$j/bench.json "$OUT/sweep-$j-bench.json" 2>/dev/null; done
fi

if has prefix; then  # the prompt-cache issue's workload, with the cache and without
  stamp "prefix-cache sweep"
  timeout ${PREFIX_TIMEOUT_S:-400} llaunch -m bench=prefix64x8 model=qwen2-7b model.load_format=dummy \
      router.max_running_requests=256 cache=default,no_prompt_cache hydra.sweep.dir=/tmp/prefix >"$OUT/prefix.log" 2>&1
  echo "prefix sweep exit: $?"; tail -3 "$OUT/prefix.log"
  llaunch-report /tmp/prefix --out "$OUT" 2>&1 | tail -8
fi

if has baseline; then
  stamp "transformers baseline"
  timeout 150 $PY .gpu/hf_baseline.py --batch 1 32 128 2>&1 | grep hf_generate | tee "$OUT/hf_baseline.txt"
fi
stamp "done"
