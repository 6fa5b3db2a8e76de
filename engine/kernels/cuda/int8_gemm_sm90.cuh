// int8 x int8 GEMM on Hopper's tensor cores (TMA loads, warp-specialized wgmma) through CUTLASS 3,
// with the engine's exact epilogue in its epilogue visitor tree:
//
//     y[m, n] = (float(acc[m, n]) * a_scale[m]) * w_scale[n]   (+ residual[m, n]),   fp32
//
// acc is the exact int32 sum of a[m, :] * w[n, :] (|acc| <= K * 127^2 < 2^31), so no tile shape,
// schedule or split can change it; the epilogue is three IEEE operations in that order (the file is
// compiled with -fmad=false, so the add is never contracted with the multiply): y equals the Triton
// kernel's and the torch reference's bit for bit. A third epilogue makes the MLP's SwiGLU from the
// gate GEMM and the up projection read as C (`swiglu_value`, the Triton kernels' instructions):
//
//     v[m, n] = silu(g) * up[m, n],   g = (float(acc[m, n]) * a_scale[m]) * w_scale[n]
//
// A fourth divides v by the next linear's SmoothQuant divisor and folds each row's absmax into a
// per-row buffer with atomic maxima, the two things the quantizer of ffn_down's input needs:
//
//     w[m, n] = v[m, n] / s[n]  (IEEE, div.rn),   absmax[m] = max over n of |w[m, n]|
//
// A maximum is exact in any order, so the atomics' order cannot change absmax; w is the value
// `quantize_rows(v, s)` divides out itself. The quantizer then only streams w against its row's
// scale (`quant.quantize_rows_by_absmax`): the same codes and scales as `quantize_rows(v, s)`.
//
// engine/kernels/cutlass_gemm.py writes one translation unit per config (PRISM_INT8_GEMM below),
// builds them into one shared library and calls it through ctypes.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace prism {
using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

constexpr auto kRound = cutlass::FloatRoundStyle::round_to_nearest;

// silu(g) * u exactly as the engine's Triton kernels compute (g / (1 + exp(-g))) * u on sm_90
// (`decode_quant._swiglu_value`; the PTX triton 3.6 emits for it, read off its sm_90 build): 0 - g,
// times log2(e) rounded to fp32, ex2.approx (no flush to zero), + 1, div.full (the approximate
// full-range division that `/` on fp32 lowers to there), times u. Inline PTX, so nvcc can neither
// contract nor substitute any step: a row's v has the same bits whichever backend served its M.
CUTLASS_DEVICE float swiglu_value(float g, float u) {
  float t, e, d, q, v;
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(t) : "f"(0.0f), "f"(g));
  asm("mul.rn.f32 %0, %1, 0f3FB8AA3B;" : "=f"(t) : "f"(t));
  asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(t));
  asm("add.rn.f32 %0, %1, 0f3F800000;" : "=f"(d) : "f"(e));
  asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"(g), "f"(d));
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(v) : "f"(q), "f"(u));
  return v;
}

// a / b correctly rounded (div.rn.f32), as `tl.math.div_rn` in the engine's quantizers: inline PTX
// so that nvcc cannot substitute an approximate division.
CUTLASS_DEVICE float divide_rn(float a, float b) {
  float q;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(b));
  return q;
}

// A binary fp32 function as a visitor tree's compute function: Sm90Compute instantiates it at float
// for its argument type and at Array<float, N> for the fragments it visits, element by element.
template <float (*Fn)(float, float)>
struct Elementwise {
  template <class T>
  struct Op {
    CUTLASS_DEVICE T operator()(T const& a, T const& b) const { return Fn(a, b); }
  };
  template <int N>
  struct Op<cutlass::Array<float, N>> {
    CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& a,
                                                       cutlass::Array<float, N> const& b) const {
      cutlass::Array<float, N> out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) out[i] = Fn(a[i], b[i]);
      return out;
    }
  };
};
template <class T>
using Swiglu = typename Elementwise<swiglu_value>::template Op<T>;  // (g, u) -> silu(g) * u
template <class T>
using DivideRn = typename Elementwise<divide_rn>::template Op<T>;  // (v, s) -> v / s

// The row absmax's step in registers: max(running, |x|), max.f32 and abs.f32 as the Triton
// quantizers' tl.maximum(amax, tl.abs(v)). Lanes and CTAs then combine the (non-negative) partial
// maxima with plain maxima, the last by atomicMax on their int bits (cutlass::atomic_maximum).
template <class T>
struct AbsMax {
  CUTLASS_DEVICE T operator()(T const& running, T const& x) const { return fmaxf(running, fabsf(x)); }
};

// What the epilogue adds after the scaling: nothing, the residual (C), the SwiGLU with C = up, or
// that SwiGLU over the divisor with its rows' absmax.
enum class Epi { kPlain, kResidual, kSwiglu, kSwigluAbsmax };

// The epilogue as a tree: w_scale[n] * (a_scale[m] * float(acc)) (+ residual, or SwiGLU with C).
// Multiplication commutes exactly in IEEE arithmetic, so these are the reference's
// (acc * a_scale) * w_scale bits.
template <class Tile, Epi E>
struct ScaleTree {
  using RowScaled = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                                    fusion::Sm90ColBroadcast<0, Tile, float, float, Stride<_1, _0, int64_t>>,
                                    fusion::Sm90AccFetch>;
  using Scaled = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                                 fusion::Sm90RowBroadcast<0, Tile, float, float, Stride<_0, _1, int64_t>>,
                                 RowScaled>;
  template <template <class> class Fn>
  using WithC = fusion::Sm90EVT<fusion::Sm90Compute<Fn, float, float, kRound>, Scaled, fusion::Sm90SrcFetch<float>>;
  // w = v / s[n], and the rows' max |w| folded atomically into absmax[m] (zeroed by the kernel's
  // initialization, CUTLASS's fill of an atomic reduction's output with its identity 0)
  using Divided = fusion::Sm90EVT<fusion::Sm90Compute<DivideRn, float, float, kRound>, WithC<Swiglu>,
                                  fusion::Sm90RowBroadcast<0, Tile, float, float, Stride<_0, _1, int64_t>>>;
  using RowAbsmax = fusion::Sm90EVT<
      fusion::Sm90ColReduction<AbsMax, cutlass::maximum_with_default_nan_propagation, cutlass::atomic_maximum, 0,
                               Tile, float, float, kRound>,
      Divided>;
  using Op = cute::conditional_t<
      E == Epi::kPlain, Scaled,
      cute::conditional_t<E == Epi::kResidual, WithC<cutlass::plus>,
                          cute::conditional_t<E == Epi::kSwiglu, WithC<Swiglu>, RowAbsmax>>>;
};

// CUTLASS fills an atomic reduction's output with the driver's cuMemsetD*Async (cutlass/workspace.h);
// this library links only the CUDA runtime, so these stand-ins do it through the runtime. Weak: a
// driver already loaded for the whole process keeps its own. The fill here is always the
// reduction's identity, 0 (any other 32/16/8-bit pattern is refused, not silently mis-set).
extern "C" __attribute__((weak)) CUresult cuMemsetD32Async(CUdeviceptr at, unsigned int value, size_t count,
                                                           CUstream stream) {
  if (value != 0) return CUDA_ERROR_NOT_SUPPORTED;
  return cudaMemsetAsync(reinterpret_cast<void*>(at), 0, count * 4, stream) == cudaSuccess ? CUDA_SUCCESS
                                                                                           : CUDA_ERROR_UNKNOWN;
}
extern "C" __attribute__((weak)) CUresult cuMemsetD16Async(CUdeviceptr at, unsigned short value, size_t count,
                                                           CUstream stream) {
  if (value != 0) return CUDA_ERROR_NOT_SUPPORTED;
  return cudaMemsetAsync(reinterpret_cast<void*>(at), 0, count * 2, stream) == cudaSuccess ? CUDA_SUCCESS
                                                                                           : CUDA_ERROR_UNKNOWN;
}
// (and the name of a failed fill's error, which its error path asks for)
extern "C" __attribute__((weak)) CUresult cuGetErrorString(CUresult, const char** name) {
  if (name != nullptr) *name = nullptr;
  return CUDA_ERROR_NOT_SUPPORTED;
}
extern "C" __attribute__((weak)) CUresult cuMemsetD8Async(CUdeviceptr at, unsigned char value, size_t count,
                                                          CUstream stream) {
  if (value != 0) return CUDA_ERROR_NOT_SUPPORTED;
  return cudaMemsetAsync(reinterpret_cast<void*>(at), 0, count, stream) == cudaSuccess ? CUDA_SUCCESS
                                                                                       : CUDA_ERROR_UNKNOWN;
}

// A [M, K] row-major (K contiguous), the weight [N, K] (K contiguous: column-major as K x N), y [M, N]
// row-major; 16-byte alignment: K % 16 == 0 and N % 4 == 0 (the caller checks).
// C (`c`: the residual, or the up projection for the SwiGLU) is read unless E is kPlain.
// Scheduler StreamK also takes its decomposition (DecompositionMode: 0 heuristic, 1 data-parallel,
// 2 split-K into Splits, 3 stream-K) and how partials meet (ReductionMode: 0 a turnstile in K order,
// 1 atomically in any order). The partials are the int32 accumulators, whose sum is exact in any
// grouping and order, so neither changes a bit.
template <class Tile, class Cluster, class MainloopSchedule, class EpilogueSchedule, class Scheduler, Epi E,
          int Swizzle = 1, int Raster = 0, int Splits = 1, int Decomposition = 0, int Reduction = 0>
struct Int8Gemm {
  using Row = cutlass::layout::RowMajor;
  using Col = cutlass::layout::ColumnMajor;
  using ElementC = cute::conditional_t<E == Epi::kPlain, void, float>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, int32_t, float, ElementC, Row, 4, float, Row, 4,
      EpilogueSchedule, typename ScaleTree<Tile, E>::Op>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, int8_t, Row, 16, int8_t, Col, 16, int32_t, Tile,
      Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // divisor and absmax: kSwigluAbsmax's s [n] and absmax [m] (unread otherwise)
  static typename Gemm::Arguments arguments(const int8_t* a, const int8_t* w, const float* a_scale,
                                            const float* w_scale, const float* c, float* y, int m, int n,
                                            int k, const float* divisor = nullptr, float* absmax = nullptr) {
    auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(m, k, 1));
    auto stride_w = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(n, k, 1));
    auto stride_c = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, make_shape(m, n, 1));
    auto stride_y = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(m, n, 1));
    int device = 0;
    cudaGetDevice(&device);
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(device);
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {m, n, k, 1},
                                  {a, stride_a, w, stride_w},
                                  {{}, reinterpret_cast<const ElementC*>(c), stride_c, y, stride_y},
                                  hw};
    typename ScaleTree<Tile, E>::RowScaled::Arguments row_scaled{{a_scale}, {}, {}};
    typename ScaleTree<Tile, E>::Scaled::Arguments scaled{{w_scale}, row_scaled, {}};
    // the order the persistent CTAs take output tiles in (which tiles share operands in L2 at a
    // time); each tile's sum is the same whatever the order, so neither changes a bit
    args.scheduler.max_swizzle_size = Swizzle;
    args.scheduler.raster_order = static_cast<cutlass::gemm::kernel::detail::RasterOrderOptions>(Raster);
    if constexpr (cute::is_same_v<Scheduler, cutlass::gemm::StreamKScheduler>) {
      args.scheduler.splits = Splits;
      args.scheduler.decomposition_mode = static_cast<cutlass::gemm::kernel::detail::DecompositionMode>(Decomposition);
      args.scheduler.reduction_mode = static_cast<cutlass::gemm::kernel::detail::ReductionMode>(Reduction);
    }
    if constexpr (E == Epi::kPlain) {
      args.epilogue.thread = scaled;
    } else if constexpr (E == Epi::kSwigluAbsmax) {
      typename ScaleTree<Tile, E>::Divided::Arguments divided{{scaled, {}, {}}, {divisor}, {}};
      args.epilogue.thread = {divided, {absmax, 0.0f, {}}};
    } else {
      args.epilogue.thread = {scaled, {}, {}};
    }
    return args;
  }

  static size_t workspace_bytes(int m, int n, int k) {
    return Gemm::get_workspace_size(arguments(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k));
  }

  // 0 launched; 1 shape not implementable; 2 initialize failed; 3 launch failed.
  static int run(const int8_t* a, const int8_t* w, const float* a_scale, const float* w_scale,
                 const float* c, float* y, int m, int n, int k, void* workspace, cudaStream_t stream,
                 const float* divisor = nullptr, float* absmax = nullptr) {
    Gemm gemm;
    auto args = arguments(a, w, a_scale, w_scale, c, y, m, n, k, divisor, absmax);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
    if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 2;
    if (gemm.run(stream) != cutlass::Status::kSuccess) return 3;
    return 0;
  }
};

using Cooperative = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using Pingpong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using CooperativeEpilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
using PingpongEpilogue = cutlass::epilogue::TmaWarpSpecialized;
using Persistent = cutlass::gemm::PersistentScheduler;
using StreamK = cutlass::gemm::StreamKScheduler;
}  // namespace prism

// Keeps a template's commas inside one macro argument. ORDER: the tile order and the work's
// decomposition, "SWIZZLE, RASTER, SPLITS, DECOMPOSITION, REDUCTION" (RasterOrderOptions: 0
// heuristic, 1 along M, 2 along N; the last three as Int8Gemm's, read only by StreamK).
#define PRISM_ARG(...) __VA_ARGS__

// One config's C entry points: prism_int8_gemm_NAME (residual may be null), prism_int8_gemm_swiglu_NAME
// (v = silu(a w^T scaled) * up: w the gate rows, up fp32 [m, n]), prism_int8_gemm_swiglu_absmax_NAME
// (v / divisor and its rows' absmax) and the workspace size any of them needs.
#define PRISM_INT8_GEMM(NAME, TILE, CLUSTER, MAINLOOP, EPILOGUE, SCHEDULER, ORDER)                                \
  using NAME##_plain = prism::Int8Gemm<TILE, CLUSTER, MAINLOOP, EPILOGUE, SCHEDULER, prism::Epi::kPlain, ORDER>;       \
  using NAME##_residual = prism::Int8Gemm<TILE, CLUSTER, MAINLOOP, EPILOGUE, SCHEDULER, prism::Epi::kResidual, ORDER>; \
  using NAME##_swiglu = prism::Int8Gemm<TILE, CLUSTER, MAINLOOP, EPILOGUE, SCHEDULER, prism::Epi::kSwiglu, ORDER>;     \
  using NAME##_absmax =                                                                                          \
      prism::Int8Gemm<TILE, CLUSTER, MAINLOOP, EPILOGUE, SCHEDULER, prism::Epi::kSwigluAbsmax, ORDER>;           \
  extern "C" size_t prism_int8_gemm_##NAME##_workspace(int m, int n, int k) {                                   \
    size_t a = NAME##_plain::workspace_bytes(m, n, k), b = NAME##_residual::workspace_bytes(m, n, k);           \
    size_t c = NAME##_swiglu::workspace_bytes(m, n, k), d = NAME##_absmax::workspace_bytes(m, n, k);            \
    size_t ab = a > b ? a : b, cd = c > d ? c : d;                                                               \
    return ab > cd ? ab : cd;                                                                                    \
  }                                                                                                              \
  extern "C" int prism_int8_gemm_##NAME(const int8_t* a, const int8_t* w, const float* a_scale,                 \
                                        const float* w_scale, const float* residual, float* y, int m, int n,     \
                                        int k, void* workspace, cudaStream_t stream) {                          \
    return residual ? NAME##_residual::run(a, w, a_scale, w_scale, residual, y, m, n, k, workspace, stream)     \
                    : NAME##_plain::run(a, w, a_scale, w_scale, residual, y, m, n, k, workspace, stream);       \
  }                                                                                                              \
  extern "C" int prism_int8_gemm_swiglu_##NAME(const int8_t* a, const int8_t* w, const float* a_scale,          \
                                               const float* w_scale, const float* up, float* v, int m, int n,    \
                                               int k, void* workspace, cudaStream_t stream) {                   \
    return NAME##_swiglu::run(a, w, a_scale, w_scale, up, v, m, n, k, workspace, stream);                       \
  }                                                                                                              \
  extern "C" int prism_int8_gemm_swiglu_absmax_##NAME(                                                           \
      const int8_t* a, const int8_t* w, const float* a_scale, const float* w_scale, const float* up,            \
      const float* divisor, float* out, float* absmax, int m, int n, int k, void* workspace,                     \
      cudaStream_t stream) {                                                                                     \
    return NAME##_absmax::run(a, w, a_scale, w_scale, up, out, m, n, k, workspace, stream, divisor, absmax);     \
  }
