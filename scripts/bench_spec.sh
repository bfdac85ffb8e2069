#!/usr/bin/env bash
# Speculative decoding's benchmark: one copy-heavy workload (scripts/bench_serving.py --copy-prompts: a
# random text twice, which the model continues by copying) against a server without and then with
# speculation, one server at a time on the same port; output tok/s side by side with the acceptance.
#
#   bash scripts/bench_spec.sh                     (a GPU: SmolLM2, 8 prompts of 1024 tokens, 256 out, c1)
#   SERVE="device=cpu model.dtype=float32" NUM=2 INPUT=64 OUTPUT=16 bash scripts/bench_spec.sh   (CPU smoke)
#
# Variables: SERVE (llaunch overrides of both servers), SPEC (the speculating one's, default spec=ngram),
#   NUM, INPUT, OUTPUT, CONCURRENCY (default 1), VOCAB (prompt ids drawn below it), PORT, OUT, PY.
set -u
if [ -z "${PY:-}" ]; then  # unset: the repo's venv where there is one
  PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
LLAUNCH=${LLAUNCH:-$(dirname "$PY")/llaunch}
command -v "$LLAUNCH" >/dev/null || LLAUNCH=llaunch
SERVE=${SERVE:-model=smollm2-135m}
SPEC=${SPEC:-spec=ngram}
NUM=${NUM:-8}; INPUT=${INPUT:-1024}; OUTPUT=${OUTPUT:-256}; CONCURRENCY=${CONCURRENCY:-1}
VOCAB=${VOCAB:-49152}; PORT=${PORT:-8000}
OUT=${OUT:-/tmp/llaunch-spec}
mkdir -p "$OUT"
status=0

for variant in none spec; do
  overrides=$([ "$variant" = spec ] && echo "$SPEC" || echo "spec=none")
  echo "== serve: llaunch $SERVE $overrides"
  "$LLAUNCH" $SERVE $overrides server.port="$PORT" hydra.run.dir="$OUT/run-$variant" >"$OUT/llaunch-$variant.log" 2>&1 &
  lpid=$!
  up=0
  for _ in $(seq 1 600); do  # until /health answers, or the launcher exits (a refused config, a crash)
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && { up=1; break; }
    kill -0 $lpid 2>/dev/null || break
    sleep 1
  done
  if [ "$up" = 1 ]; then
    model=$(curl -s "localhost:$PORT/v1/models" | $PY -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
    $PY scripts/bench_serving.py --base-url "http://127.0.0.1:$PORT" --model "$model" --copy-prompts \
      --num-prompts "$NUM" --input-len "$INPUT" --output-len "$OUTPUT" --concurrency "$CONCURRENCY" --warmup 1 \
      --vocab-size "$VOCAB" --seed 24 --result-file "$OUT/bench-$variant.json" 2>&1 \
      | grep -E "Output token throughput|Median TPOT|Spec decode|Failed"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  else
    status=1; tail -20 "$OUT/llaunch-$variant.log"
  fi
  kill -TERM $lpid 2>/dev/null; wait $lpid
done

$PY - "$OUT" <<'PYEOF'
import json, os, sys
out = sys.argv[1]
runs = {v: json.load(open(os.path.join(out, f"bench-{v}.json"))) for v in ("none", "spec")
        if os.path.exists(os.path.join(out, f"bench-{v}.json"))}
print(f"{'server':8} {'out tok/s':>10} {'TPOT med ms':>12} {'acceptance':>11} {'tok/verify':>11} {'failed':>7}")
for v, r in runs.items():
    acc = f"{100 * r['spec_acceptance_rate']:.1f}%" if "spec_acceptance_rate" in r else "n/a"
    per = f"{r['spec_tokens_per_verify']:.2f}" if "spec_tokens_per_verify" in r else "n/a"
    print(f"{v:8} {r['output_throughput']:>10.1f} {r['median_tpot_ms']:>12.2f} {acc:>11} {per:>11} {r['failed']:>7}")
if len(runs) == 2 and runs["none"]["output_throughput"]:
    print(f"speedup (spec / none, output tok/s): {runs['spec']['output_throughput'] / runs['none']['output_throughput']:.2f}x")
PYEOF
exit $status
