# issue 18 on the device: the whole GPU suite on the final tree, then the noop host cost, d3df974 (old) vs the tree
source .devcache/wheels/setup.sh > $OUT/setup.log 2>&1; tail -2 $OUT/setup.log
pip install -q --no-deps --target /opt/site .devcache/xdist/*.whl 2>&1 | tail -1
ln -sfn ../registry .devcache/old/liger_dispatch/registry; ln -sfn ../backends .devcache/old/liger_dispatch/backends
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u
timeout 300 python3 -m pytest -m gpu -q -n 6 -rs > $OUT/pytest_gpu_full.log 2>&1
echo "pytest rc=$?"; tail -4 $OUT/pytest_gpu_full.log
if grep -q "failed" $OUT/pytest_gpu_full.log; then
  timeout 120 python3 -m pytest -m gpu -q --lf -p no:randomly > $OUT/pytest_rerun.log 2>&1; echo "rerun rc=$?"; tail -3 $OUT/pytest_rerun.log
fi
date -u
for r in 1 2; do for t in old new; do
  tree=.devcache/$t; [ $t = new ] && tree=.
  MHC=0 timeout 100 python .devcache/cmds/run_old.py $tree .devcache/cmds/noop_ab.py $t 2000 2>&1 | grep handle_us
done; done | tee $OUT/noop_ab.txt
date -u
