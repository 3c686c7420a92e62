# after compaction: the whole GPU suite, host cost
source .devcache/wheels/setup.sh > $OUT/setup.log 2>&1; tail -2 $OUT/setup.log
pip install -q --no-deps --target /opt/site .devcache/xdist/*.whl 2>&1 | tail -1
cd $PWD
date -u
timeout 330 python3 -m pytest -m gpu -q -n 6 -p no:cacheprovider -rs > $OUT/pytest_gpu_full.log 2>&1
echo "pytest rc=$?"; tail -6 $OUT/pytest_gpu_full.log
date -u
timeout 150 python -m benchmarks.run host-cost --calls 200 --profile 25 --out $OUT/h200_host_cost.md > $OUT/host_cost.txt 2>&1
echo "host rc=$?"; grep -A8 "tiny shape" $OUT/h200_host_cost.md | head -12; grep "noop" $OUT/h200_host_cost.md | head -8
