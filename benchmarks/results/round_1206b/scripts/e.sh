# issue 20: where the compiled and CUDA-graph flce steps lose (after the scale-kernel grid and the static weight),
# the host cost (noop calls, tiny shape, mHC wall against GPU), then the Llama-shaped training step, eager and compiled
source .devcache/wheels/setup.sh > /dev/null 2>&1
date -u
timeout 75 python -m benchmarks.run --ops mhc_coeffs --tc 512x1024 2048x4096 --providers ours ours:compile --dtypes bf16 --mode fwd+bwd --rep-ms 100 --out $OUT/m > $OUT/bench_mhc.txt 2>&1; echo "mhc rc=$?"; cp $OUT/m/*.md $OUT/bench_mhc.md; rm -rf $OUT/m; grep -E "^\| T" $OUT/bench_mhc.md | cut -c1-90
timeout 120 python -m benchmarks.run kernel-times --op flce --n 1024 4096 --providers ours ours:compile ours:cudagraphs > $OUT/kernel_times_flce_compile.txt 2>&1
echo "kt rc=$?"; grep -iE "total|scale|copy|poi" $OUT/kernel_times_flce_compile.txt | head -20
timeout 150 python -m benchmarks.run host-cost --calls 100 --profile 25 --out $OUT/host_cost.md > $OUT/host_cost.txt 2>&1
echo "host rc=$?"; grep -A8 "tiny shape" $OUT/host_cost.md | head -12
timeout 70 python .devcache/cmds/tiny_probe.py > $OUT/tiny_probe.txt 2>&1; echo "tiny rc=$?"; cat $OUT/tiny_probe.txt | tail -12
date -u
