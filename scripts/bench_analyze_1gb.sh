#!/usr/bin/env bash
# `optiq analyze` against Holistic Trace Analysis on a 1 GB Kineto trace (2-core CPU machine), fresh process each.
# Needs HTA in its own venv: python3 -m venv /tmp/hta-venv && /tmp/hta-venv/bin/pip install HolisticTraceAnalysis
set -euo pipefail
SRC=${1:-traces/llama-3.1-8b_eager_C64.json.gz}
python3 ../shared/anchors/make_big_trace.py "$SRC" /tmp/big.json --target-mb 1000
ls -la /tmp/big.json
/usr/bin/time -f "optiq analyze: %e s wall, %M KB max RSS" optiq analyze /tmp/big.json --json > /tmp/big-optiq.json
/usr/bin/time -f "HTA ijson_batch_and_compress: %e s wall, %M KB max RSS" \
    /tmp/hta-venv/bin/python scripts/hta_kernel_breakdown.py /tmp/big.json ijson_batch_and_compress
