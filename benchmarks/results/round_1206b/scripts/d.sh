# issue 20 and 18: every provider of the LM-head losses (auto, per backend, compiled, CUDA graphs, the peers), then mHC
source .devcache/wheels/setup.sh > /dev/null 2>&1
date -u
timeout 300 python -m benchmarks.run --ops flce fused_linear_jsd fused_linear_kl_div --shapes llama3 --n 1024 4096 16384 --providers ours triton cutedsl helion ours:compile ours:cudagraphs torch.compile liger-kernel cut-cross-entropy --dtypes bf16 --mode fwd+bwd --rep-ms 100 --max-row-s 15 --time-budget-s 260 --out $OUT/r > $OUT/bench.txt 2>&1
echo "bench rc=$?"
timeout 110 python -m benchmarks.run --ops mhc_coeffs --tc 512x1024 2048x4096 --providers ours triton cutedsl helion ours:compile ours:cudagraphs liger-kernel --dtypes bf16 --mode fwd+bwd --rep-ms 100 --out $OUT/r > $OUT/bench_mhc.txt 2>&1
echo "mhc rc=$?"
cp $OUT/r/*.md $OUT/r/*.csv $OUT/ 2>/dev/null; rm -rf $OUT/r
grep -E "^\| (N|T)" $OUT/*.md | grep -E "\| (ours|ours:compile|ours:cudagraphs|triton|cutedsl|helion|torch.compile|liger-kernel) \|" | cut -c1-120
date -u
