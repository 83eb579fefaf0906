#!/usr/bin/env bash
# Device call A (H200): GPU engine tests, qwen3-0.6b sweeps (eager; graph + torch.compile peer), qwen3 traces.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OPTIQ_CACHE_DIR=/tmp/optiq-cache
mkdir -p $OUT/runs /tmp/traces
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee $OUT/log.txt
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a $OUT/log.txt
python3 -m pytest -q -rs tests/test_engine.py 2>&1 | tail -15 | tee -a $OUT/log.txt
W="--prompt-len 512 --new-tokens 128 --max-len 1024 --concurrency 1,16,64 --runs-dir $OUT/runs"
python3 -m optiq bench --model qwen3-0.6b --mode eager $W 2>&1 | tee -a $OUT/log.txt
python3 -m optiq bench --model qwen3-0.6b --mode graph --compare compile $W 2>&1 | tee -a $OUT/log.txt
python3 scripts/capture_traces.py /tmp/traces qwen3-0.6b 1,64 2>&1 | tee -a $OUT/log.txt
tar -C /tmp -cf $OUT/traces.tar traces; tar -C $OUT -cf $OUT/runs.tar runs; rm -rf $OUT/runs
