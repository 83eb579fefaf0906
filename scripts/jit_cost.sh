#!/usr/bin/env bash
# What Triton's JIT costs optiq's time to optimized, on the device (carry .whl): `optiq bench --recipes R` twice on
# MODEL, first with an empty Triton cache, then with the cache the first run left; the kernels the first compiled,
# with when (seconds since the first), go to $OUT/kernels_cold.txt. Usage: scripts/jit_cost.sh MODEL RECIPES
# (session 9: llama-3.1-8b decode_attention,gate_up_swiglu,attention_prologue,add_rmsnorm,decode_linear,rmsnorm,
# greedy_sample; OPTIQ_COMPILE_AHEAD=0 in the environment measures without compiling ahead).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 OPTIQ_CACHE_DIR=/tmp/optiq-cache TRITON_CACHE_DIR=/tmp/tcache
rm -rf /tmp/tcache /tmp/optiq-cache ~/.triton
for pass in cold warm; do
  timeout 250 python3 -m optiq bench --model "$1" --recipes "$2" --runs-dir "$OUT/$pass" 2>&1 | tail -8
  find /tmp/tcache -name '*.json' ! -name '__grp*' -printf '%T@ %f\n' | sort \
    | awk 'NR == 1 {t0 = $1} {printf "%.2f %s\n", $1 - t0, $2}' > "$OUT/kernels_$pass.txt"
  wc -l "$OUT/kernels_$pass.txt"
done
