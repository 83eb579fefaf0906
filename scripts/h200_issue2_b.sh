#!/usr/bin/env bash
# Device call B (H200, carry .whl: ijson, plotly, narwhals, nvtx wheels for python 3.12): llama-3.1-8b sweeps
# (eager; graph + torch.compile peer) and traces of llama and the MoE preset.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 OPTIQ_CACHE_DIR=/tmp/optiq-cache
mkdir -p $OUT/runs /tmp/traces
W="--prompt-len 512 --new-tokens 128 --max-len 1024 --concurrency 1,16,64 --runs-dir $OUT/runs"
python3 -m optiq bench --model llama-3.1-8b --mode eager $W 2>&1 | tee $OUT/log.txt
python3 -m optiq bench --model llama-3.1-8b --mode graph --compare compile $W 2>&1 | tee -a $OUT/log.txt
python3 scripts/capture_traces.py /tmp/traces llama-3.1-8b 1,64 2>&1 | tee -a $OUT/log.txt
python3 scripts/capture_traces.py /tmp/traces qwen3-30b-a3b 1,64 2>&1 | tee -a $OUT/log.txt
tar -C /tmp -cf $OUT/traces.tar traces; tar -C $OUT -cf $OUT/runs.tar runs; rm -rf $OUT/runs
