# issue 18: noop host cost, d3df974 (old) vs the tree (new), interleaved; then auto's rows on d3df974 with d.sh's arguments
source .devcache/wheels/setup.sh > /dev/null 2>&1
ln -sfn ../registry liger_dispatch/registry; ln -sfn ../backends liger_dispatch/backends
date -u
for r in 1 2 3; do for t in old new; do
  tree=.devcache/$t; [ $t = new ] && tree=.
  MHC=0 timeout 60 python .devcache/cmds/run_old.py $tree .devcache/cmds/noop_ab.py $t 2000 2>&1 | grep -E "handle_us|Error" | tail -4
done; done | tee $OUT/noop_ab.txt
rm liger_dispatch/registry liger_dispatch/backends
date -u
timeout 230 python .devcache/cmds/run_old.py .devcache/old benchmarks.run --ops flce fused_linear_jsd fused_linear_kl_div --shapes llama3 --n 1024 4096 16384 --providers ours --dtypes bf16 --mode fwd+bwd --rep-ms 100 --max-row-s 15 --time-budget-s 180 --out $OUT/old > $OUT/bench_old.txt 2>&1
echo "old rc=$?"
timeout 80 python .devcache/cmds/run_old.py .devcache/old benchmarks.run --ops mhc_coeffs --tc 512x1024 2048x4096 --providers ours --dtypes bf16 --mode fwd+bwd --rep-ms 100 --out $OUT/old_mhc > $OUT/bench_old_mhc.txt 2>&1
echo "old mhc rc=$?"
for d in old old_mhc; do cp $OUT/$d/*.md $OUT/bench_$d.md; rm -rf $OUT/$d; grep -E "^\| (N|T)" $OUT/bench_$d.md | cut -c1-70; done
date -u
