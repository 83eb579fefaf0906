"""What the gate compares with, in higher precision than the model computes.

- ``float64``: the original path of one patched site run in float64 (the per-recipe check).
- ``fp32``: the whole model computing in fp32 while its weights stay stored as they are (the end-to-end check of a
  half-precision model), made fast enough for a gate on a GPU by three helpers that share no code with the kernels
  under test: ``split_matmul`` (fp32 products of bf16 weights on tensor cores), ``experts`` (every MoE expert on every
  token of a decode step, in two batched GEMMs a graph can capture) and ``attention`` (decode attention with the
  query heads grouped by kv head instead of HF's copies of the keys and values).
"""
