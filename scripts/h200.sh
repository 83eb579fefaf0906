#!/usr/bin/env bash
# Device calls on the H200 (carry .whl). Usage: scripts/h200.sh STAGE...
#   tests          the kernels' GPU tests (preset shapes, CUDA-graph replay, torch.compile) and the graph-mode gate
#   apply:MODEL    optiq apply-fusion --model MODEL --recipes auto --compare compile on workload W1
#                  (C=1,16,64, prompt 512, 128 new tokens, cache 1024, 3 repeats)
#   profile:MODEL  optiq profile --model MODEL --concurrency 64
#   rope           scripts/rope_rounding.py: which rounding the rope kernel does on the GPU
#   bench:F[,F]    scripts/bench_fusions.py for those fusions (e.g. bench:moe_experts,mla_decode) into $OUT
#   tiles:F        scripts/tiles.py F: fusion F (moe_experts, linear) under fixed tile configs against its heuristic
#   gpu-tests:F[,F]  the GPU tests of those fusions only
# Every run directory comes back as MODEL-KIND.tgz (eager traces left out when the archive would pass 15 MB), packed
# after each stage. An apply or profile stage stops after STAGE_S seconds (default 480; keep it under the device
# call's own limit, or a call killed mid-stage brings back nothing of that stage: session 4 lost a MoE run so).
set -uo pipefail
STAGE_S=${STAGE_S:-480}
archive() {  # what optiq wrote so far is kept: a stopped run still has its report.json and traces up to then
  cd "$OUT/runs" 2>/dev/null || return 0
  for run in *; do
    tar -czf "../$run.tgz" "$run"
    [ "$(stat -c %s "../$run.tgz")" -lt 15000000 ] || tar -czf "../$run.tgz" --exclude='*eager*' "$run"
    rm -rf "$run"
  done
  cd - >/dev/null
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 OPTIQ_CACHE_DIR=/tmp/optiq-cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee -a $OUT/log.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a $OUT/log.txt
for stage in "$@"; do
  echo "=== $stage $(date +%T)" | tee -a $OUT/log.txt
  case $stage in
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -k "not _cpu" tests/fusions \
             tests/test_validation.py::test_graph_mode_gate_checks_the_captured_patched_model 2>&1 | tee -a $OUT/log.txt ;;
    apply:*) timeout "$STAGE_S" python3 -m optiq apply-fusion --model "${stage#apply:}" --recipes auto --compare compile \
               --runs-dir "$OUT/runs/${stage#apply:}-apply" 2>&1 | tee -a $OUT/log.txt ;;
    rope) python3 scripts/rope_rounding.py 2>&1 | tee -a $OUT/log.txt ;;
    tiles:*) timeout 300 python3 scripts/tiles.py "${stage#tiles:}" "$OUT/tiles_${stage#tiles:}.json" 2>&1 \
               | tee -a $OUT/log.txt ;;
    gpu-tests:*) names=${stage#gpu-tests:}
                 timeout 300 python3 -m pytest -q -p no:cacheprovider -k "not _cpu" \
                   $(printf 'tests/fusions/test_%s.py ' ${names//,/ }) 2>&1 | grep -v DEBUG | tee -a $OUT/log.txt ;;
    bench:*) names=${stage#bench:}
             timeout 300 python3 scripts/bench_fusions.py "$OUT/fusions.json" ${names//,/ } 2>&1 | tee -a $OUT/log.txt ;;
    profile:*) timeout "$STAGE_S" python3 -m optiq profile --model "${stage#profile:}" --concurrency 64 --top 1 \
                 --runs-dir "$OUT/runs/${stage#profile:}-profile" 2>&1 | tee -a $OUT/log.txt ;;
  esac
  archive
done
rmdir "$OUT/runs" 2>/dev/null || true
