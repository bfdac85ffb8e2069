#!/usr/bin/env bash
# Speculative decoding's benchmark: a copy-heavy workload (scripts/bench_serving.py --copy-prompts: a passage of
# this repository's docs or code twice, which the model continues by copying, as it re-emits a text it edits;
# COPY=random: random token ids twice) against servers without and with speculation, one server at a time on the
# same port; output tok/s side by side with the acceptance, per case.
#
#   bash scripts/bench_spec.sh                     (a GPU: SmolLM2, cases c1 and c64, three servers)
#   SERVE="device=cpu model.dtype=float32" CASES=c1 NUM=2 INPUT=64 OUTPUT=16 bash scripts/bench_spec.sh   (CPU smoke)
#
# Cases (each server runs all, each case on prompts of its own seed):
#   c1    NUM (32) prompts one at a time: the single-stream speed-up (target: >= 2x with spec=ngram)
#   c64   C64_NUM (512) prompts at concurrency 64: speculation must not be slower than none. The spec server
#         runs the default policy (no speculation in steps of more than spec.max_batch decode rows: 64 for
#         spec=ngram); spec_mb16 speculates up to 16 rows only (ngram's default before 2026-12-05, 0.95x none at c64).
# Servers (VARIANTS, default "none spec spec_mb16"): none = spec=none, spec = $SPEC, spec_mb16 = $SPEC spec.max_batch=16,
# spec_mb64 = $SPEC spec.max_batch=64,
# unchained = $SPEC spec.chain=false (each proposing row waits for its verdict: what chaining gains), k8 = $SPEC
# spec.num_tokens=8 (longer proposals: on a model whose steps cost the same at 5 and 9 tokens, more tokens a verify;
# bb9de56, H100: c1 2.67x none against k = 4's 2.07x), k16 = $SPEC spec.num_tokens=16 (the longest allowed),
# adaptive = $SPEC spec.adaptive=true (each row's proposals 1 token longer than it recently accepted), k8a = k8 with
# spec.adaptive=true (long proposals where they hold, short where they fail: c64's verify compute); ahead /
# k8ahead = spec / k8 with spec.draft_ahead=true (spec=draft: proposals drafted behind the verdict); NAME_ri: NAME
# with kernels.row_invariant=true (its c1 texts held against none_ri's).
# Each server warms with a short run of each case (not counted), then runs every case REPEATS (3) times on fresh
# prompts; the summary's row is a server's slowest run, its ratio against the slowest run of none.
# Variables: SERVE (llaunch overrides of every server), SPEC (default spec=ngram), CASES, VARIANTS, NUM, C64_NUM, REPEATS,
#   INPUT, OUTPUT, COPY (text or random), TOKENIZER (COPY=text: the served model's tokenizer.json or its folder,
#   default .models/smollm2-135m), VOCAB (COPY=random: prompt ids drawn below it), PORT, OUT, PY, TRACE=1 (each server's router.step_trace: after
#   its runs, where run 1 of each case spent its time by step kind, decode and verify apart, and the device's waits),
#   PROFILE_STEPS (after the runs, that many steps of one more c1 request under torch.profiler: server.profile_dir,
#   POST /start_profile; the kernels table's top is printed, the trace stays under OUT/profile-<server>).
set -u
if [ -z "${PY:-}" ]; then  # unset: the repo's venv where there is one
  PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
LLAUNCH=${LLAUNCH:-$(dirname "$PY")/llaunch}
command -v "$LLAUNCH" >/dev/null || LLAUNCH=llaunch
SERVE=${SERVE:-model=smollm2-135m}
SPEC=${SPEC:-spec=ngram}
CASES=${CASES:-c1 c64}
VARIANTS=${VARIANTS:-none spec spec_mb16}
# c1 of 8 prompts ran ~0.5 s on an H100 and its three none runs spread 2,051-2,577 tok/s (2026-12-05): 32 a run
NUM=${NUM:-32}; C64_NUM=${C64_NUM:-512}; INPUT=${INPUT:-1024}; OUTPUT=${OUTPUT:-256}; REPEATS=${REPEATS:-3}
VOCAB=${VOCAB:-49152}; PORT=${PORT:-8000}
COPY=${COPY:-text}; TOKENIZER=${TOKENIZER:-.models/smollm2-135m}
OUT=${OUT:-/tmp/llaunch-spec}
mkdir -p "$OUT"
status=0

case_args() {  # num-prompts concurrency seed
  case $1 in
    c1) echo "$NUM 1 24" ;;
    c64) echo "$C64_NUM 64 64" ;;
    *) echo "unknown case $1 (c1, c64)" >&2; return 1 ;;
  esac
}

for variant in $VARIANTS; do
  base=${variant%_ri}  # NAME_ri: NAME's server with kernels.row_invariant=true (a verify row summed as a decode row)
  case $base in
    none) overrides="spec=none" ;;
    spec) overrides="$SPEC" ;;
    spec_mb16) overrides="$SPEC spec.max_batch=16" ;;
    spec_mb64) overrides="$SPEC spec.max_batch=64" ;;
    unchained) overrides="$SPEC spec.chain=false" ;;
    k8) overrides="$SPEC spec.num_tokens=8" ;;
    k16) overrides="$SPEC spec.num_tokens=16" ;;
    adaptive) overrides="$SPEC spec.adaptive=true" ;;
    k8a) overrides="$SPEC spec.num_tokens=8 spec.adaptive=true" ;;
    ahead) overrides="$SPEC spec.draft_ahead=true" ;;
    k8ahead) overrides="$SPEC spec.num_tokens=8 spec.draft_ahead=true" ;;
    *) echo "unknown variant $variant (none, spec, spec_mb16, spec_mb64, unchained, k8, k16, adaptive, k8a, ahead, k8ahead; each also as NAME_ri)"
       status=1; continue ;;
  esac
  [ "$base" != "$variant" ] && overrides="$overrides kernels.row_invariant=true"
  echo "== serve: llaunch $SERVE $overrides"
  trace=${TRACE:+$OUT/trace-$variant.jsonl}
  rm -f "$OUT/trace-$variant.jsonl"
  profiles=${PROFILE_STEPS:+$OUT/profile-$variant}
  "$LLAUNCH" $SERVE $overrides server.port="$PORT" hydra.run.dir="$OUT/run-$variant" ${trace:+router.step_trace=$trace} \
    ${profiles:+server.profile_dir=$profiles} >"$OUT/llaunch-$variant.log" 2>&1 &
  lpid=$!
  up=0
  for _ in $(seq 1 600); do  # until /health answers, or the launcher exits (a refused config, a crash)
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && { up=1; break; }
    kill -0 $lpid 2>/dev/null || break
    sleep 1
  done
  if [ "$up" = 1 ]; then
    model=$(curl -s "localhost:$PORT/v1/models" | $PY -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
    # run 0 warms the server (Triton's kernels for the case's step shapes compile during a first run, and
    # their disk cache would favour whichever server runs later); runs 1..REPEATS are measured
    for r in $(seq 0 "$REPEATS"); do
      for c in $CASES; do
        read -r num conc seed < <(case_args "$c") || { status=1; continue; }
        [ "$r" = 0 ] && num=$(( conc * 2 < num ? conc * 2 : num ))
        echo "-- $variant $c run $r: $num prompts, concurrency $conc"
        $PY -c "import time; print(time.monotonic())" > "$OUT/window-$variant-$c-$r.txt"
        smi=""  # the card's clocks while the run is timed (scripts/clock_summary.py)
        if command -v nvidia-smi >/dev/null; then
          $PY scripts/clock_summary.py --sample "$OUT/clocks-$variant-$c-$r.csv" 2>/dev/null &
          smi=$!
        fi
        $PY scripts/bench_serving.py --base-url "http://127.0.0.1:$PORT" --model "$model" --copy-prompts "$COPY" \
          --num-prompts "$num" --input-len "$INPUT" --output-len "$OUTPUT" --concurrency "$conc" --warmup 1 \
          --vocab-size "$VOCAB" --tokenizer "$TOKENIZER" --seed $(( seed + 1000 * r )) --result-file "$OUT/bench-$variant-$c-$r.json" \
          $([ "$c" = c1 ] && echo --keep-text) 2>&1 \
          | grep -E "Output token throughput|Median TPOT|Spec decode|Failed"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
        $PY -c "import time; print(time.monotonic())" >> "$OUT/window-$variant-$c-$r.txt"
        if [ -n "$smi" ]; then
          kill $smi 2>/dev/null; wait $smi 2>/dev/null; $PY scripts/clock_summary.py "$OUT/clocks-$variant-$c-$r.csv"
        fi
      done
    done
    if [ -n "$trace" ]; then  # run 1 of each case, from the router's step trace
      for c in $CASES; do
        echo "   $variant $c run 1, step trace:"
        $PY scripts/step_trace_report.py "$trace" --bins 1 --pipeline --window $(cat "$OUT/window-$variant-$c-1.txt") \
          | sed "s/^/   /"
      done
    fi
    if [ -n "$profiles" ]; then  # after the measured runs: PROFILE_STEPS steps of one c1 request under torch.profiler
      curl -s -X POST "localhost:$PORT/start_profile" -H 'Content-Type: application/json' \
        -d "{\"num_steps\": $PROFILE_STEPS}" >/dev/null
      $PY scripts/bench_serving.py --base-url "http://127.0.0.1:$PORT" --model "$model" --copy-prompts "$COPY" \
        --num-prompts 1 --input-len "$INPUT" --output-len "$OUTPUT" --concurrency 1 --vocab-size "$VOCAB" \
        --tokenizer "$TOKENIZER" --seed 999 --result-file "$OUT/profiled-$variant.json" >/dev/null 2>&1
      for _ in $(seq 1 30); do ls "$profiles"/*.kernels.txt >/dev/null 2>&1 && break; sleep 1; done
      echo "   $variant: $PROFILE_STEPS steps of a c1 request by kernel ($profiles)"
      head -28 "$profiles"/worker-0-0-1.kernels.txt 2>/dev/null | cut -c1-160 | sed "s/^/   /"
    fi
    # the server's speculation counters since its start (warm-up run included): chained and voided verifies
    curl -s "localhost:$PORT/metrics" | grep -E "^llaunch:spec_decode_num_(drafts|chained|voided|backoffs)_total" \
      | sed "s/^/   $variant /"
  else
    status=1; tail -20 "$OUT/llaunch-$variant.log"
  fi
  kill -TERM $lpid 2>/dev/null; wait $lpid
done

$PY - "$OUT" "$CASES" "$VARIANTS" "$REPEATS" <<'PYEOF'
import json, os, sys
out, cases, variants, repeats = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), int(sys.argv[4])
print(f"{'case':5} {'server':10} {'runs':>4} {'out tok/s min':>13} {'max':>8} {'vs none':>8} {'TPOT med ms':>12} {'acceptance':>11} {'tok/verify':>11} {'hit rate':>9} {'failed':>7}")
for c in cases:
    runs = {}  # per server, its measured runs (run 0 warmed it); the row shows the slowest run's figures
    for v in variants:
        rs = [json.load(open(p)) for r in range(1, repeats + 1) if os.path.exists(p := os.path.join(out, f"bench-{v}-{c}-{r}.json"))]
        if rs:
            hits = [x.get("prefix_cache_hit_rate") for x in rs]  # the highest of the runs: fresh prompts hit ~0
            hit = "n/a" if None in hits else f"{100 * max(hits):.2f}%"
            runs[v] = (min(rs, key=lambda x: x["output_throughput"]), max(x["output_throughput"] for x in rs), len(rs), hit)
    base = runs.get("none", ({},))[0].get("output_throughput")
    for v, (r, best, n, hit) in runs.items():
        acc = f"{100 * r['spec_acceptance_rate']:.1f}%" if "spec_acceptance_rate" in r else "n/a"
        per = f"{r['spec_tokens_per_verify']:.2f}" if "spec_tokens_per_verify" in r else "n/a"
        ratio = f"{r['output_throughput'] / base:.2f}x" if base else "n/a"
        print(f"{c:5} {v:10} {n:>4} {r['output_throughput']:>13.1f} {best:>8.1f} {ratio:>8} {r['median_tpot_ms']:>12.2f} "
              f"{acc:>11} {per:>11} {hit:>9} {r['failed']:>7}")
PYEOF
# the same prompts' greedy texts, each spec server's against spec=none's (#38: in bfloat16 too)
if [[ " $CASES " == *" c1 "* && " $VARIANTS " == *" none "* ]]; then
  $PY scripts/spec_text_agreement.py "$OUT" --case c1 --variants $VARIANTS --repeats "$REPEATS"
fi
exit $status
