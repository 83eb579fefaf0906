"""Small traces written the way vLLM and SGLang write theirs today (and before), for optiq's engine-trace tests.

Every name below comes from the engines' code, read from the wheels on the package index:

- vLLM 0.34.0 (``vllm/_version.py``: commit g62d4bc3c7): ``vllm/v1/worker/gpu_worker.py`` (``Worker.annotate_profile``
  lines 1327-1438, ``execute_model`` 1474, ``sample_tokens`` 1441, ``profile`` 1508-1552),
  ``vllm/distributed/utils.py`` ``get_worker_rank_suffix`` (818-856), ``vllm/v1/engine/async_llm.py`` (237-243, the
  frontend trace), ``vllm/profiler/wrapper.py`` (``TorchProfilerWrapper`` 266-270: torch's tensorboard_trace_handler
  names the file ``{worker_name}.{time_ns}.pt.trace.json.gz``; ``create_frontend_profiler`` 789-809: CPU only),
  ``vllm/v1/engine/core.py`` ``EngineCore.step`` (713-754: execute_model, then sample_tokens, then
  take_draft_token_ids); kernel symbols from the wheel's ``vllm/_C_stable_libtorch.abi3.so`` (demangled) and its
  Triton kernels (``vllm/model_executor/layers/fused_moe/fused_moe.py`` 298 ``fused_moe_kernel``).
- SGLang 0.5.23 (wheel ``sglang-0.5.23-cp311``): ``sglang/srt/utils/profile_utils.py`` ``build_step_span_name``
  (462-505), ``sglang/srt/model_executor/model_runner.py`` (1832-1860: the span around ``_forward_raw``; ``sample``
  2103, outside it), ``sglang/srt/managers/scheduler_components/profiler_manager.py`` (``_stop_profile`` 318-390:
  ``{prefix-}{profile_id}-TP-{t}[-DP-d][-PP-p][-EP-e][-{stage}].trace.json.gz``; 162-192 the merge),
  ``sglang/srt/utils/profile_merger.py`` (``merged-{profile_id}.trace.json.gz``; ``_create_rank_label`` 115-122,
  ``_process_events`` 143-159: every pid becomes ``"[TP00] {pid}"``, other top-level keys kept from the first file),
  ``sglang/kernels/ops/attention/decode_attention.py`` (235 ``_fwd_kernel_stage1``, 530 ``_fwd_grouped_kernel_stage1``,
  935 ``_fwd_kernel_stage2``).
- Older formats, from the issue (#27) that reported them: vLLM before Dec 2025 ``execute_new_{n}_cached_{m}``; SGLang
  before ``VERIFY``/``DRAFT``: ``step[TARGET_VERIFY ...]`` and ``step[DRAFT_EXTEND ...]`` with no span around the draft
  model's own decode passes.
- FlashInfer's kernels (SGLang's norm, activation, rotary, decode attention and sampling; vLLM's sampler), from
  flashinfer-python 0.7.4's headers under ``flashinfer/data/include/flashinfer/``: ``norm.cuh`` (63 ``RMSNormKernel``,
  424 ``FusedAddRMSNormKernel``, namespace ``flashinfer::norm``), ``activation.cuh`` (34 ``act_and_mul_kernel``,
  namespace ``flashinfer::activation``), ``pos_enc.cuh`` (362 ``BatchQKApplyRotaryPosIdsCosSinCacheKernel``),
  ``attention/decode.cuh`` (629 ``BatchDecodeWithPagedKVCacheKernel``), ``sampling.cuh`` (1227
  ``TopKTopPSamplingFromProbKernel``, namespace ``flashinfer::sampling``).

The timings are made up, and chosen so that a test can compute every answer by hand: one stream, kernels back to
back, each a whole number of microseconds. ``python tests/data/engine_traces.py OUT_DIR`` writes every fixture.
"""

from __future__ import annotations

import gzip
import json
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# --- kernel names, as Kineto writes them (demangled, with their parameter list) -----------------------------------
# vLLM csrc, from the symbols of vllm/_C_stable_libtorch.abi3.so
VLLM_RMS_NORM = ("void vllm::rms_norm_kernel<c10::BFloat16, 8, 4, false>(c10::BFloat16*, long, long, "
                 "c10::BFloat16 const*, c10::BFloat16 const*, float, int, int)")
VLLM_ADD_RMS_NORM = ("std::enable_if<((8)==(0))||(!vllm::_typeConvert<c10::BFloat16>::exists), void>::type "
                     "vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8, false>(c10::BFloat16*, long, c10::BFloat16*, "
                     "c10::BFloat16 const*, float, int, int)")
VLLM_SILU_AND_MUL = ("void vllm::act_and_mul_kernel<c10::BFloat16, __nv_bfloat162, &(c10::BFloat16 "
                     "vllm::silu_kernel<c10::BFloat16>(c10::BFloat16 const&)), true, false>(c10::BFloat16*, "
                     "c10::BFloat16 const*, int)")
VLLM_ROTARY = ("void vllm::rotary_embedding_kernel<c10::BFloat16, c10::BFloat16, true>(long const*, "
               "c10::BFloat16*, c10::BFloat16*, c10::BFloat16 const*, int, long, long, long, int, int, int)")
VLLM_CACHE_WRITE = ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, "
                    "(vllm::Fp8KVCacheDataType)0>(__nv_bfloat16 const*, __nv_bfloat16 const*, __nv_bfloat16*, "
                    "__nv_bfloat16*, long const*, long, long, long, long, long, int, int, int, float const*, "
                    "float const*)")
VLLM_CUSTOM_ALL_REDUCE = ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(vllm::RankData*, "
                          "vllm::RankSignals, vllm::Signal*, __nv_bfloat16*, int, int)")
VLLM_SCALED_MM = ("void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8<cutlass::float_e4m3_t, "
                  "cutlass::bfloat16_t>>(vllm::cutlass_scaled_mm_sm90_fp8::Params)")
# vllm_flash_attn (FlashAttention 2's split-KV decode kernel, as vLLM builds it)
FLASH_DECODE = ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, "
                "cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 4, cutlass::bfloat16_t> >, false, false, "
                "false, false, true, true, false, false>(flash::Flash_fwd_params)")
FLASH_PREFILL = ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
                 "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, "
                 "false, false, false, true, false, false>(flash::Flash_fwd_params)")
# Triton kernels keep their Python names: vLLM's fused_moe.py 298, moe_align_block_size's CUDA kernel
FUSED_MOE = "fused_moe_kernel"
MOE_ALIGN = ("void vllm::moe::moe_align_block_size_kernel<int>(int const*, int*, int*, int*, int, int, int, int, "
             "unsigned long, int*, int)")
# cuBLAS (via torch's mm) for the unquantized projections
CUBLAS_GEMM = "nvjet_tst_64x8_64x16_4x1_v_bz_TNT"
# NCCL's device kernels (NCCL >= 2.19 names them ncclDevKernel_*)
NCCL_ALL_REDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
# FlashInfer 0.7.4 (include/flashinfer/norm.cuh, activation.cuh, pos_enc.cuh, attention/decode.cuh, sampling.cuh)
FI_RMS_NORM = ("void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, "
               "__nv_bfloat16*, unsigned int, unsigned int, unsigned int, float, float)")
FI_ADD_RMS_NORM = ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, "
                   "__nv_bfloat16*, unsigned int, unsigned int, unsigned int, float, float)")
FI_SILU_AND_MUL = ("void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, &silu>(__nv_bfloat16*, "
                   "__nv_bfloat16 const*, int)")
FI_ROTARY = ("void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheKernel<true, 128u, 8u, 16u, __nv_bfloat16, long>"
             "(__nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, float*, long*, unsigned int, "
             "unsigned int, unsigned int, unsigned int, unsigned long, unsigned long, unsigned long, unsigned long, "
             "unsigned long, unsigned long, unsigned long, unsigned long)")
FI_DECODE = ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEncodingMode)0, 2u, 4u, 8u, 16u, "
             "1u, 8u, flashinfer::DefaultAttention<false, false, false, false>, flashinfer::BatchDecodeParams<"
             "__nv_bfloat16, __nv_bfloat16, __nv_bfloat16, int> >(flashinfer::BatchDecodeParams<__nv_bfloat16, "
             "__nv_bfloat16, __nv_bfloat16, int>)")
FI_SAMPLING = ("void flashinfer::sampling::TopKTopPSamplingFromProbKernel<1024u, (cub::BlockScanAlgorithm)2, "
               "(cub::BlockReduceAlgorithm)2, 4u, true, float, int>(float*, int*, int*, float*, int*, float*, "
               "unsigned int, unsigned int, unsigned long, unsigned long)")
# SGLang's Triton decode attention (sglang/kernels/ops/attention/decode_attention.py 530 and 935)
SGL_TRITON_DECODE = ("_fwd_grouped_kernel_stage1", "_fwd_kernel_stage2")
# ATen kernels both engines launch around sampling
SOFTMAX = ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
           "at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)")
ARGMAX = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
          "unsigned int, long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
          "long, 4, 4>)")

# One decoder layer's decode kernels and their microseconds: the class each must be read as is the test's answer.
VLLM_LAYER = [(VLLM_ADD_RMS_NORM, 3), (CUBLAS_GEMM, 12), (VLLM_ROTARY, 2), (VLLM_CACHE_WRITE, 2), (FLASH_DECODE, 20),
              (CUBLAS_GEMM, 8), (VLLM_CUSTOM_ALL_REDUCE, 6), (VLLM_ADD_RMS_NORM, 3), (VLLM_SCALED_MM, 25),
              (VLLM_SILU_AND_MUL, 4), (VLLM_SCALED_MM, 15), (NCCL_ALL_REDUCE, 10)]
VLLM_MOE_LAYER = [(VLLM_ADD_RMS_NORM, 3), (CUBLAS_GEMM, 12), (VLLM_ROTARY, 2), (FLASH_DECODE, 20), (CUBLAS_GEMM, 8),
                  (VLLM_ADD_RMS_NORM, 3), (MOE_ALIGN, 3), (FUSED_MOE, 40), (VLLM_SILU_AND_MUL, 4), (FUSED_MOE, 30),
                  (NCCL_ALL_REDUCE, 10)]
SGL_LAYER = [(FI_ADD_RMS_NORM, 3), (CUBLAS_GEMM, 12), (FI_ROTARY, 2), (FI_DECODE, 20), (CUBLAS_GEMM, 8),
             (VLLM_CUSTOM_ALL_REDUCE, 6), (FI_ADD_RMS_NORM, 3), (CUBLAS_GEMM, 25), (FI_SILU_AND_MUL, 4),
             (CUBLAS_GEMM, 15), (NCCL_ALL_REDUCE, 10)]
SGL_TRITON_LAYER = [(FI_RMS_NORM, 3), (CUBLAS_GEMM, 12), (FI_ROTARY, 2), (SGL_TRITON_DECODE[0], 14),
                    (SGL_TRITON_DECODE[1], 4), (CUBLAS_GEMM, 8), (FI_RMS_NORM, 3), (CUBLAS_GEMM, 25),
                    (FI_SILU_AND_MUL, 4), (CUBLAS_GEMM, 15)]
HEAD = [(VLLM_RMS_NORM, 3), (CUBLAS_GEMM, 30)]  # the final norm and lm_head
# After the step, each launched by its op: 18 us (flashinfer's Python op ``top_k_top_p_sampling_from_probs``)
SAMPLING = [(SOFTMAX, 5, "aten::_softmax"), (FI_SAMPLING, 9, "flashinfer::top_k_top_p_sampling_from_probs"),
            (ARGMAX, 4, "aten::argmax")]
DRAFT = [(CUBLAS_GEMM, 10), (FLASH_DECODE, 6), (CUBLAS_GEMM, 4)]  # one draft-model pass: 20 us
PREFILL = [(VLLM_RMS_NORM, 9), (CUBLAS_GEMM, 80), (FLASH_PREFILL, 60), (CUBLAS_GEMM, 70)]
LAYERS = 2
COLLECTIVES = (VLLM_CUSTOM_ALL_REDUCE, NCCL_ALL_REDUCE)
SKEW_US = 5  # each rank's collectives wait this much longer than the rank before


def layer_kernels(layer: list, rank: int = 0) -> list[tuple[str, int]]:
    """A decode forward's kernels: ``LAYERS`` layers, then the head; rank r's collectives take r * SKEW_US more."""
    return [(name, us + (rank * SKEW_US if name in COLLECTIVES else 0)) for name, us in layer] * LAYERS + HEAD


def forward_us(layer: list, rank: int = 0) -> int:
    """The GPU time of one decode step of ``rank``: the answer to "decode ms per step"."""
    return sum(us for _, us in layer_kernels(layer, rank))


def collective_us(layer: list, rank: int = 0) -> int:
    """The collectives' part of it."""
    return sum(us for name, us in layer_kernels(layer, rank) if name in COLLECTIVES)


@dataclass
class Timeline:
    """One process's events: a host thread that launches, one GPU stream that runs what it launched in order, and
    the correlation and External ids Kineto gives them (counted from 1 on every rank, as they are)."""

    pid: int
    tid: int
    device: int
    host: float = 1_000_000.0
    gpu: float = 0.0
    ids: int = 0
    events: list = field(default_factory=list)

    def _next_id(self) -> int:
        self.ids += 1
        return self.ids

    @contextmanager
    def span(self, name: str, cat: str = "user_annotation"):
        """A record_function range around what runs inside it (``cat`` cpu_op for an op)."""
        start = self.host
        self.host += 1
        yield
        self.host += 1
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": self.pid, "tid": self.tid, "ts": start,
                            "dur": self.host - start})

    def _kernel(self, name: str, us: int, launch_ts: float, correlation: int, external: int) -> None:
        self.gpu = max(self.gpu, launch_ts + 3)
        self.events.append({"ph": "X", "cat": "kernel", "name": name, "pid": self.device, "tid": 7, "ts": self.gpu,
                            "dur": us, "args": {"device": self.device, "stream": 7, "correlation": correlation,
                                                "External id": external}})
        self.gpu += us

    def eager(self, kernels: list[tuple[str, int]], op: str = "aten::mm") -> None:
        """Each kernel launched by its own op (``cudaLaunchKernel`` inside the op's range)."""
        for name, us in kernels:
            correlation = self._next_id()
            with self.span(op, cat="cpu_op"):
                launch = self.host
                self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": self.pid,
                                    "tid": self.tid, "ts": launch, "dur": 2, "args": {"correlation": correlation}})
                self.host += 3
            self.events[-1]["args"] = {"External id": correlation}  # the op's event, written as its range ended
            self._kernel(name, us, launch, correlation, correlation)

    def graph(self, kernels: list[tuple[str, int]]) -> None:
        """One CUDA-graph replay: a single ``cudaGraphLaunch`` whose kernels share its correlation and have no op."""
        correlation = self._next_id()
        launch = self.host
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "pid": self.pid,
                            "tid": self.tid, "ts": launch, "dur": 8, "args": {"correlation": correlation}})
        self.host += 10
        for name, us in kernels:
            self._kernel(name, us, launch, correlation, 0)

    def sample(self, kernels=SAMPLING) -> None:
        for name, us, op in kernels:
            self.eager([(name, us)], op=op)

    def python(self, name: str, us: int) -> None:
        """A with_stack Python frame (the only events of vLLM's frontend trace)."""
        self.events.append({"ph": "X", "cat": "python_function", "name": name, "pid": self.pid, "tid": self.tid,
                            "ts": self.host, "dur": us, "args": {"Python id": self._next_id()}})
        self.host += us + 1

    def wait_for_gpu(self) -> None:
        """The host blocks on the GPU (a .tolist() of sampled tokens): the next step starts after this one ends."""
        self.host = max(self.host, self.gpu) + 20


def document(timeline: Timeline, rank: int, world: int) -> dict:
    """A rank's trace file: Kineto writes distributedInfo when torch.distributed is initialised."""
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
            "deviceProperties": [{"id": timeline.device, "name": "NVIDIA H200"}], "traceEvents": timeline.events}


def write(path: Path, doc: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


# --- vLLM --------------------------------------------------------------------------------------------------------

def vllm_marker(context: int, context_tokens: int, generation: int, style: str = "plain") -> str:
    """The step's record_function name, as Worker.annotate_profile builds it (gpu_worker.py 1340-1437); "old" is the
    pre-Dec-2025 ``execute_new_{n}_cached_{m}`` (new requests, running ones)."""
    if style == "old":
        return f"execute_new_{context}_cached_{generation}"
    if style == "detailed":  # one token per generating request, each with 10 tokens of KV before it
        sk = generation * 11
        return (f"execute_{context_tokens + generation}_context_{context}(sq{context_tokens}sk{context_tokens}"
                f"sqsq{context_tokens ** 2}sqsk{context_tokens ** 2})_generation_{generation}(sq{generation}sk{sk}"
                f"sqsq{generation}sqsk{sk})")
    return f"execute_context_{context}({context_tokens})_generation_{generation}({generation})"


def vllm_worker(rank: int, decode_steps: int, style: str = "plain", layer=VLLM_LAYER,
                speculative: bool = False) -> Timeline:
    """One worker: a prefill step (eager, piecewise graphs aside), then decode steps replayed from a full CUDA graph,
    each followed by sample_tokens outside the step's range (EngineCore.step), which also drafts when speculative."""
    t = Timeline(pid=4000 + rank, tid=4000 + rank, device=rank)
    with t.span(vllm_marker(1, 16, 0, style)):
        t.eager(PREFILL)
    t.sample(SAMPLING[:1])
    t.wait_for_gpu()
    for _ in range(decode_steps):
        with t.span(vllm_marker(0, 0, 4, style)):
            t.graph(layer_kernels(layer, rank))
        t.sample()
        if speculative:  # Worker.sample_tokens -> speculator.propose: no range of its own
            t.graph(DRAFT)
        t.wait_for_gpu()
    if style == "detailed":  # a chunked-prefill step that mixes a new request with the running ones: not decode
        with t.span("execute_5_context_1(sq4sk4sqsq16sqsk16)_generation_1(sq1sk11sqsq1sqsk11)"):
            t.eager(PREFILL)
    return t


def vllm_name(rank: int, prefix: str = "") -> str:
    """``{prefix_}dp{d}_pp{p}_tp{t}_dcp{c}_ep{e}_rank{g}.{time_ns}.pt.trace.json.gz`` (TP only here)."""
    suffix = f"dp0_pp0_tp{rank}_dcp0_ep0_rank{rank}"
    return f"{prefix + '_' if prefix else ''}{suffix}.1764770000000000{rank}.pt.trace.json.gz"


def vllm_frontend(out: Path) -> Path:
    """AsyncLLM's CPU-only frontend trace (``{host}_{pid}.async_llm``): Python frames, no op, no GPU event."""
    t = Timeline(pid=3000, tid=3000, device=-1)
    for frame in ("vllm/v1/engine/async_llm.py(420): generate", "vllm/v1/engine/output_processor.py(501): "
                  "process_outputs", "asyncio/events.py(88): _run"):
        t.python(frame, 40)
    return write(out / "gpu-host_3000.async_llm.1764770000000000000.pt.trace.json.gz",
                 {"schemaVersion": 1, "traceEvents": t.events})


def vllm_traces(out: Path, ranks: int = 2, decode_steps: int = 3, style: str = "plain", layer=VLLM_LAYER,
                speculative: bool = False, frontend: bool = True) -> list[Path]:
    """A vLLM profile folder: one file per worker rank, and the frontend's trace beside them."""
    paths = [write(out / vllm_name(r), document(vllm_worker(r, decode_steps, style, layer, speculative), r, ranks))
             for r in range(ranks)]
    return paths + ([vllm_frontend(out)] if frontend else [])


# --- SGLang ------------------------------------------------------------------------------------------------------

def sglang_step(mode: str, bs: int, toks: int | None = None) -> str:
    """build_step_span_name (profile_utils.py 462-505): ``step[{stage} bs={bs}]``, with ``toks=`` for EXTEND."""
    return f"step[{mode} bs={bs}{f' toks={toks}' if toks is not None else ''}]"


def sglang_rank(rank: int, decode_steps: int, layer=SGL_LAYER, speculative: str = "", stages=("EXTEND", "DECODE"),
                mixed: bool = False) -> Timeline:
    """One scheduler process: an EXTEND (prefill) step, then decode steps, each followed by ModelRunner.sample
    outside its span. Speculative "new": the draft model's passes in step[DRAFT] spans, the target's verify in
    step[VERIFY]; "old": step[TARGET_VERIFY] and step[DRAFT_EXTEND], the draft's own decode passes with no span."""
    t = Timeline(pid=31337 + rank, tid=31337 + rank, device=rank)
    if "EXTEND" in stages:
        with t.span(sglang_step("EXTEND", 1, 16)):
            t.eager(PREFILL)
        t.sample(SAMPLING[:1])
        t.wait_for_gpu()
    if "DECODE" not in stages:
        return t
    for _ in range(decode_steps):
        if speculative == "new":
            for _ in range(2):
                with t.span(sglang_step("DRAFT", 4)):
                    t.graph(DRAFT)
        elif speculative == "old":
            t.graph(DRAFT)
            t.graph(DRAFT)
        verify = {"new": "VERIFY", "old": "TARGET_VERIFY"}.get(speculative, "DECODE")
        with t.span(sglang_step(verify, 4)):
            t.graph(layer_kernels(layer, rank))
        t.sample()
        if speculative:
            with t.span(sglang_step("DRAFT" if speculative == "new" else "DRAFT_EXTEND", 4)):
                t.graph(DRAFT)
        t.wait_for_gpu()
    if mixed:  # a prefill chunk batched with decodes (ForwardMode.MIXED): not a decode step
        with t.span(sglang_step("MIXED", 5)):
            t.eager(PREFILL)
    return t


def sglang_name(profile_id: str, rank: int, stage: str = "") -> str:
    """``{profile_id}-TP-{t}[-{stage}].trace.json.gz`` (profiler_manager._stop_profile; DP/PP/EP only when > 1)."""
    return f"{profile_id}-TP-{rank}{f'-{stage}' if stage else ''}.trace.json.gz"


def sglang_traces(out: Path, ranks: int = 2, decode_steps: int = 3, layer=SGL_LAYER, speculative: str = "",
                  mixed: bool = False, profile_id: str = "1764770000.123") -> list[Path]:
    return [write(out / sglang_name(profile_id, r), document(sglang_rank(r, decode_steps, layer, speculative,
                                                                         mixed=mixed), r, ranks))
            for r in range(ranks)]


def sglang_by_stage(out: Path, ranks: int = 2, decode_steps: int = 3, profile_id: str = "1764770000.123") -> list:
    """profile_by_stage: an -EXTEND and a -DECODE file per rank (the stage's name as output suffix)."""
    return [write(out / sglang_name(profile_id, r, stage), document(sglang_rank(r, decode_steps, stages=(stage,)),
                                                                    r, ranks))
            for r in range(ranks) for stage in ("EXTEND", "DECODE")]


def sglang_merged(out: Path, ranks: int = 2, decode_steps: int = 3, profile_id: str = "1764770000.123") -> Path:
    """ProfileMerger.merge_chrome_traces: every rank's events in one list, each pid rewritten to "[TP0r] pid", and
    the other top-level keys (distributedInfo too) kept from the first file only."""
    merged: dict = {"traceEvents": []}
    for r in range(ranks):
        doc = document(sglang_rank(r, decode_steps), r, ranks)
        for event in doc["traceEvents"]:
            event["pid"] = f"[TP{r:02d}] {event['pid']}"
        merged["traceEvents"].extend(doc.pop("traceEvents"))
        for key, value in doc.items():
            merged.setdefault(key, value)
    return write(out / f"merged-{profile_id}.trace.json.gz", merged)


def main(out: str) -> None:
    root = Path(out)
    vllm_traces(root / "vllm")
    vllm_traces(root / "vllm-detailed", style="detailed", frontend=False)
    vllm_traces(root / "vllm-old", style="old", frontend=False)
    vllm_traces(root / "vllm-moe", layer=VLLM_MOE_LAYER, frontend=False)
    vllm_traces(root / "vllm-spec", speculative=True, frontend=False)
    sglang_traces(root / "sglang", mixed=True)
    sglang_traces(root / "sglang-triton", ranks=1, layer=SGL_TRITON_LAYER)
    sglang_traces(root / "sglang-spec", speculative="new")
    sglang_traces(root / "sglang-spec-old", speculative="old")
    sglang_by_stage(root / "sglang-by-stage")
    sglang_merged(root / "sglang-merged")


if __name__ == "__main__":
    main(sys.argv[1])
