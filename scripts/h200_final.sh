#!/usr/bin/env bash
# Device call (H200, carry .whl): optiq profile of llama-3.1-8b (graph, C=64) and the fusion microbenchmarks.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 OPTIQ_CACHE_DIR=/tmp/optiq-cache
mkdir -p $OUT/runs
python3 -m optiq profile --model llama-3.1-8b --concurrency 64 --top 1 --runs-dir $OUT/runs 2>&1 | tee $OUT/log.txt
timeout 150 python3 scripts/bench_fusions.py $OUT/fusions.json 2>&1 | grep -v Warning | tee -a $OUT/log.txt
(cd $OUT && tar -cf runs.tar runs && rm -rf runs)
