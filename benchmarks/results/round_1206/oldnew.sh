# benchmark rows of auto selection, d3df974 (old) and the tree (new), one machine start
source .devcache/wheels/setup.sh > /dev/null 2>&1
for t in old new; do
  tree=.devcache/$t; [ $t = new ] && tree=.
  timeout 280 python .devcache/cmds/run_old.py $tree benchmarks.run --ops flce fused_linear_jsd fused_linear_kl_div --shapes llama3 --n 1024 4096 16384 --providers ours --rep-ms 300 --time-budget-s 150 --out $OUT/$t > $OUT/bench_$t.txt 2>&1
  echo "$t rc=$?"; cp $OUT/$t/*.md $OUT/bench_$t.md; rm -rf $OUT/$t
  grep -E "^\| N=" $OUT/bench_$t.md | cut -c1-60
done
