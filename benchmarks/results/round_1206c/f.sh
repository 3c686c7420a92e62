# What the next GPU start runs (pending since round_1206c): the direct launches of 069da21 / 3e7547b, the no_grad mean
# (65bea84, cd76080) and the compiled one-chunk weight gradient (e823a37, 5fad899). Carry .devcache/wheels (and stage
# CuTeDSL first for the tune line and any auto row that would pick it).
source .devcache/wheels/setup.sh > /tmp/s.log 2>&1; tail -2 /tmp/s.log; date -u
timeout 150 python3 -m pytest -m gpu -q -n 6 -p no:randomly tests/test_launch.py tests/test_valid_rows.py tests/test_triton_kernels.py tests/test_conformance.py tests/test_flce_options.py -k "triton or launch or valid" > $OUT/pytest_gpu_triton.log 2>&1
echo "pytest rc=$?"; tail -3 $OUT/pytest_gpu_triton.log; date -u
LIGER_BACKEND=triton timeout 230 python -m benchmarks.run --ops flce fused_linear_jsd fused_linear_kl_div --shapes llama3 --n 1024 4096 --providers ours ours:compile --dtypes bf16 --mode fwd+bwd --rep-ms 100 --max-row-s 15 --time-budget-s 190 --out $OUT/bench > $OUT/bench.txt 2>&1
echo "bench rc=$?"; date -u
timeout 100 python -m benchmarks.run host-cost --backends triton --calls 100 --profile 25 --out $OUT/host_cost.md > $OUT/host_cost.txt 2>&1
echo "host rc=$?"; grep -B2 -A8 "tiny shape" $OUT/host_cost.md | head -14; date -u
timeout 200 python3 -m pytest -m gpu -q -p no:randomly tests/test_torch_ops.py > $OUT/pytest_gpu_torch_ops.log 2>&1
echo "pytest torch_ops rc=$?"; tail -2 $OUT/pytest_gpu_torch_ops.log; date -u
# then, on an H100: python -m liger_dispatch tune --ops fused_linear_logprobs --n 1024 4096 16384 --reps 15 --out liger_dispatch/tuning/tables/h100.json
