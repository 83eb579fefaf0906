"""The peer for `optiq analyze` on big traces: Holistic Trace Analysis' kernel breakdown of one trace file.
Run in a separate venv with HolisticTraceAnalysis installed: python hta_kernel_breakdown.py TRACE [json|ijson_batch_and_compress]"""

import os
import shutil
import sys
import tempfile
import time

from hta.configs.parser_config import ParserBackend, ParserConfig
from hta.trace_analysis import TraceAnalysis

trace, backend = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "ijson_batch_and_compress")
config = ParserConfig.get_default_cfg()
config.set_parser_backend(ParserBackend(backend))
ParserConfig.set_default_cfg(config)
folder = tempfile.mkdtemp()
os.symlink(os.path.abspath(trace), os.path.join(folder, os.path.basename(trace)))
start = time.perf_counter()
kernel_type, kernels = TraceAnalysis(trace_dir=folder).get_gpu_kernel_breakdown(visualize=False)
print(f"HTA ({backend}): {time.perf_counter() - start:.1f} s; {len(kernels)} kernel rows")
print(kernel_type.to_string()[:800])
shutil.rmtree(folder)
