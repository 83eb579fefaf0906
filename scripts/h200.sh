#!/usr/bin/env bash
# Device calls on the H200 (carry .whl). Usage: scripts/h200.sh STAGE...
#   tests          the kernels' GPU tests (preset shapes, CUDA-graph replay, torch.compile) and the graph-mode gate
#   apply:MODEL    optiq apply-fusion --model MODEL --recipes auto --compare $COMPARE on workload W1 (COMPARE
#                  defaults to compile; COMPARE= leaves it out, for a model whose compile warm-up fills a call)
#                  (C=1,16,64, prompt 512, 128 new tokens, cache 1024, 3 repeats)
#   profile:MODEL  optiq profile --model MODEL --concurrency 64
#   row:MODEL      optiq bench --model MODEL --compare $PEERS --recipes auto on workload W1: one row of the issue-6
#                  table in one run (PEERS defaults to eager,compile; PEERS=compile leaves out HF eager, hf adds
#                  HF's own step on its own cache; ROW_C sets the concurrencies, 1,16,64 by default; PEER_BUDGET
#                  the peers' warm-up budget, 900 s)
#   bench:F[,F]    scripts/bench_fusions.py for those fusions (e.g. bench:moe_experts,mla_decode) into $OUT
#   tiles:F        scripts/tiles.py F: fusion F (moe_experts, linear, decode_attention) under fixed tile configs
#                  against its heuristic, at TILES_ROWS rows (default 1,16,64), the cases TILES_CASES names (default
#                  all; TILES_CONTEXT sets decode_attention's filled positions), into tiles_F$TILES_TAG.json
#   gpu-tests:F[,F]  the GPU tests of those fusions only
#   pytest:T[,T]   those test files (paths under tests/), GPU tests included
#   verify:MODEL   optiq recipes verify --mutants --model MODEL at W1's gate (C=${VERIFY_C:-1,16,64}, prompt 512,
#                  cache 1024, 64 steps, graph): every recipe alone, with its real kernel and each mutant
#   margins:MODEL  scripts/gate_margins.py MODEL bf16 1,16,64 512 1024: the correct kernels' error distributions
#   knob:MODEL=R[,R]        scripts/knob_ab.py: decode tok/s of MODEL patched with recipes R under each value of
#                  a measuring knob, alternating (KNOB, default OPTIQ_PDL=0,1; KNOB_C the concurrencies, 1,16,64)
#   gate-profile:MODEL=R[,R]  scripts/gate_profile.py: cProfile of the gate on MODEL patched with recipes R
# Every run directory comes back as MODEL-KIND.tgz (eager traces left out when the archive would pass 15 MB), packed
# after each stage. An apply or profile stage stops after STAGE_S seconds (default 480), and every stage by the time
# the call has left: CALL_S (default 570) is the device call's own limit less a margin for the last archive, so a
# stage that cannot finish is stopped and packed rather than lost with the call (sessions 4 and 5 lost runs so).
set -uo pipefail
STAGE_S=${STAGE_S:-480}
COMPARE=${COMPARE-compile}
PEERS=${PEERS:-eager,compile}
CALL_S=${CALL_S:-570}
limit() {  # seconds a stage may run: its own limit, or what the call has left if that is less
  local left=$(( CALL_S - SECONDS ))
  echo $(( left < $1 ? left : $1 ))
}
archive() {  # what optiq wrote so far is kept: a stopped run still has its report.json and traces up to then
  cd "$OUT/runs" 2>/dev/null || return 0
  for run in *; do
    [ -e "$run" ] || continue  # nothing written yet (the pattern stayed as it is)
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
# Every dependency in pyproject.toml must import before any stage runs (session 6 lost a call to a missing wheel).
python3 - <<'PY' 2>&1 | tee -a $OUT/log.txt || exit
import importlib.util, re, sys, tomllib
names = [re.split(r"[<>=!~ \[]", d)[0] for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]]
missing = [n for n in names if importlib.util.find_spec(n) is None]
sys.exit(f"missing on the device (add their wheels to .whl): {', '.join(missing)}" if missing else 0)
PY
failed=()
for stage in "$@"; do
  if (( $(limit 300) < 30 )); then
    echo "=== $stage skipped: the call has $(limit 300) s left" | tee -a $OUT/log.txt
    continue
  fi
  echo "=== $stage $(date +%T)" | tee -a $OUT/log.txt
  case $stage in
    tests) timeout "$(limit 300)" python3 -m pytest -q -p no:cacheprovider -k "not _cpu" tests/fusions \
             tests/test_validation.py::test_graph_mode_gate_checks_the_captured_patched_model 2>&1 | tee -a $OUT/log.txt ;;
    apply:*) timeout "$(limit "$STAGE_S")" python3 -m optiq apply-fusion --model "${stage#apply:}" --recipes auto \
               ${COMPARE:+--compare "$COMPARE"} --runs-dir "$OUT/runs/${stage#apply:}-apply" 2>&1 | tee -a $OUT/log.txt ;;
    tiles:*) timeout "$(limit 300)" python3 scripts/tiles.py "${stage#tiles:}" \
               "$OUT/tiles_${stage#tiles:}${TILES_TAG:-}.json" "${TILES_ROWS:-1,16,64}" "${TILES_CASES:-}" 2>&1 \
               | tee -a $OUT/log.txt ;;
    gpu-tests:*) names=${stage#gpu-tests:}
                 timeout "$(limit 300)" python3 -m pytest -q -p no:cacheprovider -k "not _cpu" \
                   $(printf 'tests/fusions/test_%s.py ' ${names//,/ }) 2>&1 | grep -v DEBUG | tee -a $OUT/log.txt ;;
    pytest:*) files=${stage#pytest:}
              timeout "$(limit 300)" python3 -m pytest -q -p no:cacheprovider ${files//,/ } 2>&1 | tee -a $OUT/log.txt ;;
    bench:*) names=${stage#bench:}
             timeout "$(limit 300)" python3 scripts/bench_fusions.py "$OUT/fusions.json" ${names//,/ } 2>&1 \
               | tee -a $OUT/log.txt ;;
    knob:*) spec=${stage#knob:}
            timeout "$(limit "$STAGE_S")" python3 scripts/knob_ab.py "${spec%%=*}" "${spec#*=}" \
              "$OUT/knob_${spec%%=*}.json" "${KNOB:-OPTIQ_PDL=0,1}" "${KNOB_C:-1,16,64}" 2>&1 | tee -a $OUT/log.txt ;;
    gate-profile:*) spec=${stage#gate-profile:}
                    timeout "$(limit "$STAGE_S")" python3 scripts/gate_profile.py "${spec%%=*}" "${spec#*=}" \
                      "$OUT/gate_profile_${spec%%=*}.txt" 2>&1 | tee -a $OUT/log.txt ;;
    row:*) timeout "$(limit "$STAGE_S")" python3 -m optiq bench --model "${stage#row:}" --compare "$PEERS" \
             --concurrency "${ROW_C:-1,16,64}" --peer-budget "${PEER_BUDGET:-900}" \
             --recipes auto --runs-dir "$OUT/runs/${stage#row:}-row" 2>&1 | tee -a $OUT/log.txt ;;
    verify:*) timeout "$(limit "$STAGE_S")" python3 -m optiq recipes verify --mutants --model "${stage#verify:}" \
                --concurrency "${VERIFY_C:-1,16,64}" --json --runs-dir "$OUT/runs/${stage#verify:}-verify" \
                > "$OUT/verify_${stage#verify:}.json" 2> >(tee -a $OUT/log.txt >&2) ;;
    margins:*) timeout "$(limit "$STAGE_S")" python3 scripts/gate_margins.py "${stage#margins:}" bf16 1,16,64 512 1024 \
                 "$OUT/margins_${stage#margins:}.json" 2>&1 | tee -a $OUT/log.txt ;;
    profile:*) timeout "$(limit "$STAGE_S")" python3 -m optiq profile --model "${stage#profile:}" --concurrency 64 \
                 --top 1 --runs-dir "$OUT/runs/${stage#profile:}-profile" 2>&1 | tee -a $OUT/log.txt ;;
  esac
  (( $? == 0 )) || failed+=("$stage")
  archive
done
rmdir "$OUT/runs" 2>/dev/null || true
(( ${#failed[@]} == 0 )) || { echo "=== failed: ${failed[*]}" | tee -a $OUT/log.txt; exit 1; }
