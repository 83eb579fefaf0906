#!/usr/bin/env bash
# Issue 7: `optiq analyze` on a 2 GB Kineto trace (plain JSON and gzip) stays within bounded memory.
set -euo pipefail
SRC=${1:-traces/llama-3.1-8b_eager_C64.json.gz}
python3 ../shared/anchors/make_big_trace.py "$SRC" /tmp/big2g.json --target-mb 2000
ls -la /tmp/big2g.json
/usr/bin/time -f "optiq analyze 2 GB json: %e s wall, %M KB max RSS" optiq analyze /tmp/big2g.json --json > /tmp/big2g.out
gzip -1 -k -f /tmp/big2g.json && ls -la /tmp/big2g.json.gz
/usr/bin/time -f "optiq analyze 2 GB json.gz: %e s wall, %M KB max RSS" optiq analyze /tmp/big2g.json.gz --json \
    > /tmp/big2g-gz.out
python3 -c "import json; a, b = (json.load(open(p))['results'][0] for p in ('/tmp/big2g.out', '/tmp/big2g-gz.out')); \
print('same attribution from .json and .json.gz:', all(a[k] == b[k] for k in a if k not in ('scope', 'files')))"
