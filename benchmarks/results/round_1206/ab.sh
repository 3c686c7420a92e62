# host cost of the noop handle call, d3df974 (old) / 1528ab5 (pre: this session's start) / the tree (new), interleaved
source .devcache/wheels/setup.sh > /dev/null 2>&1
for r in 1 2 3; do for t in old pre new; do
  tree=.devcache/$t; [ $t = new ] && tree=.
  MHC=0 timeout 100 python .devcache/cmds/run_old.py $tree .devcache/cmds/noop_ab.py $t 2000 2>&1 | grep handle_us
done; done | tee $OUT/noop_ab.txt
