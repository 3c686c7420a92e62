#!/usr/bin/env bash
# The GPU run in one command, on the GPU host after `source .devcache/wheels/setup.sh`:
# `pytest -m gpu`, then the full benchmark (every op at llama3, N in {1024, 4096, 8192, 16384}, bf16,
# fwd+bwd, every provider), everything under $OUT. It fits in 10 minutes: the tests get at most
# 4 minutes, the benchmark starts no row after 8 minutes in all (results are written as rows finish),
# and a size a provider cannot fit or finish within --max-row-s is skipped, saying why.
# `bash benchmarks/device.sh --bench-only` skips the tests: the whole 10 minutes go to the benchmark.
set -uo pipefail
: "${OUT:?set OUT to the folder the results and logs go to}"
cd "$(dirname "$0")/.."
start=$SECONDS
mkdir -p "$OUT/results"
cp benchmarks/results/*.csv "$OUT/results/" 2>/dev/null  # earlier rows: the run merges into them

tests=0
if [ "${1:-}" != "--bench-only" ]; then
  echo "== pytest -m gpu (log: \$OUT/pytest-gpu.log)"
  timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider >"$OUT/pytest-gpu.log" 2>&1
  tests=$?
  tail -n 15 "$OUT/pytest-gpu.log"
fi

budget=$((480 - (SECONDS - start)))
echo "== benchmark, ${budget} s budget (log: \$OUT/benchmark.log)"
python3 -m benchmarks.run --ops all --shapes llama3 --n 1024 4096 8192 16384 --dtypes bf16 --mode fwd+bwd \
    --rep-ms 120 --max-row-s 25 --time-budget-s "$budget" --out "$OUT/results" 2>&1 | tee "$OUT/benchmark.log"
bench=${PIPESTATUS[0]}

echo "== tests exit $tests, benchmark exit $bench, $((SECONDS - start)) s; results in \$OUT/results"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
