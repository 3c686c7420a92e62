# round_1206c, after b1ed51f: the Triton loss kernels' direct launch on the GPU (tests), host cost, log-prob entries
source .devcache/wheels/setup.sh > /tmp/s.log 2>&1; tail -2 /tmp/s.log; date -u
timeout 110 python3 -m pytest -m gpu -q -n 6 -p no:randomly tests/test_launch.py tests/test_triton_kernels.py tests/test_conformance.py tests/test_flce_options.py tests/test_flce_liger_options.py tests/test_kl_semantics.py -k "triton or launch" > $OUT/pytest_gpu_triton.log 2>&1
echo "pytest rc=$?"; tail -3 $OUT/pytest_gpu_triton.log; date -u
timeout 120 python -m benchmarks.run host-cost --calls 100 --profile 25 --out $OUT/host_cost.md > $OUT/host_cost.txt 2>&1
echo "host rc=$?"; grep -B2 -A8 "tiny shape" $OUT/host_cost.md | head -14; grep -A12 "^| T x C" $OUT/host_cost.md | head -14; date -u
# next start, after 069da21: the same two steps verify the misaligned-scale launch, then the log-prob entries of h100.json
# timeout 120 python -m liger_dispatch tune --ops fused_linear_logprobs --n 1024 4096 16384 --reps 15 --out liger_dispatch/tuning/tables/h100.json
