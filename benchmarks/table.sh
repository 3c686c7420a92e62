#!/usr/bin/env bash
# The full performance table, every row of it, in parts of under 10 minutes each (one GPU call a part), on the GPU
# host after `source .devcache/wheels/setup.sh` with CuTeDSL staged; everything under $OUT:
#   tune       time the three LM-head losses' backends on this card into $OUT/<card>.json (2.5 min); copy it to
#              liger_dispatch/tuning/tables/ before the other parts, which read the package's table
#   flce-jsd   flce and JSD at N = 1024 / 4096 / 16384: ours per backend and auto, eager, compiled and in CUDA
#              graphs, torch.compile, liger-kernel, cut-cross-entropy (9.5 min)
#   kl-mhc     KL the same way (no cut-cross-entropy), then mHC at both shapes (6 min)
#   host-step  host cost (tiny flce rows, mHC eager wall against GPU time), the Llama-shaped step eager and
#              compiled, then `pytest -m gpu` over the compiled and launch paths (9.5 min)
# DRY_RUN=1 prints the commands instead (tests/test_benchmarks.py parses them).
set -uo pipefail
: "${OUT:?set OUT to the folder the results and logs go to}"
cd "$(dirname "$0")/.."
part=${1:?"usage: bash benchmarks/table.sh tune|flce-jsd|kl-mhc|host-step"}
N="1024 4096 16384"
OURS="ours triton cutedsl helion ours:compile ours:cudagraphs"
TIMING="--dtypes bf16 --mode fwd+bwd --rep-ms 100 --max-row-s 15"

step() {  # step SECONDS LOG COMMAND...: COMMAND under a time limit, its output to $OUT/LOG
  local limit=$1 log=$2
  shift 2
  if [ -n "${DRY_RUN:-}" ]; then printf "%q " "$@"; echo; return 0; fi
  echo "== $* (limit ${limit} s, log \$OUT/$log)"
  timeout "$limit" "$@" >"$OUT/$log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$log"
  echo "== exit $rc at $(date -u +%H:%M:%S)"
  return $rc
}

case $part in
  tune)
    card=cpu
    [ -n "${DRY_RUN:-}" ] || card=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")
    step 170 tune.txt python3 -m liger_dispatch tune --ops flce fused_linear_jsd fused_linear_kl_div --n $N \
      --betas 0.5 --reps 15 --budget-s 150 --out "$OUT/$card.json" ;;
  flce-jsd)
    step 575 flce_jsd.txt python3 -m benchmarks.run --ops flce fused_linear_jsd --shapes llama3 --n $N \
      --providers $OURS torch.compile liger-kernel cut-cross-entropy $TIMING --time-budget-s 530 --out "$OUT/results" ;;
  kl-mhc)
    step 290 kl.txt python3 -m benchmarks.run --ops fused_linear_kl_div --shapes llama3 --n $N \
      --providers $OURS torch.compile liger-kernel $TIMING --time-budget-s 270 --out "$OUT/results"
    kl=$?
    step 80 mhc.txt python3 -m benchmarks.run --ops mhc_coeffs --tc 512x1024 2048x4096 --providers $OURS \
      liger-kernel $TIMING --out "$OUT/results"
    [ $kl -eq 0 ] ;;
  host-step)
    step 110 host_cost_log.txt python3 -m benchmarks.run host-cost --calls 100 --profile 25 --out "$OUT/host_cost.md"
    host=$?
    step 200 hf_step_log.txt python3 -m benchmarks.run hf-step --compile --rep-ms 1000 --out "$OUT/hf_step.md"
    hf=$?
    step 240 pytest_gpu.log python3 -m pytest -m gpu -q -n 6 -p no:randomly -p no:cacheprovider \
      tests/test_torch_ops.py tests/test_launch.py tests/test_valid_rows.py tests/test_triton_kernels.py \
      tests/test_conformance.py tests/test_flce_options.py -k "triton or launch or valid or compile or torch_ops"
    tests=$?
    [ $host -eq 0 ] && [ $hf -eq 0 ] && [ $tests -eq 0 ] ;;
  *)
    echo "usage: bash benchmarks/table.sh tune|flce-jsd|kl-mhc|host-step" >&2
    exit 2 ;;
esac
