// int8 x int8 GEMM on Hopper's tensor cores (TMA loads, warp-specialized wgmma) through CUTLASS 3,
// with the engine's exact epilogue in its epilogue visitor tree:
//
//     y[m, n] = (float(acc[m, n]) * a_scale[m]) * w_scale[n]   (+ residual[m, n]),   fp32
//
// acc is the exact int32 sum of a[m, :] * w[n, :] (|acc| <= K * 127^2 < 2^31), so no tile shape,
// schedule or split can change it; the epilogue is three IEEE operations in that order (the file is
// compiled with -fmad=false, so the add is never contracted with the multiply): y equals the Triton
// kernel's and the torch reference's bit for bit. A third epilogue makes the MLP's SwiGLU in the
// same GEMM (kSwigluPairs): the stored gate+up weight's rows are interleaved, row 2j the gate's row
// j and row 2j + 1 the up's, so a tile holds both values of each of its outputs, and wgmma's
// accumulator layout puts them in one thread, in neighbouring registers (columns 2j and 2j + 1 of a
// row). Its visitor tree pairs them (`PairNode`) with the Triton kernels' instructions
// (`swiglu_value`) and stores v straight from registers into out [M, N / 2]; the [M, N] tile itself
// is never written (D is void):
//
//     v[m, j] = silu(g) * u,   g = y[m, 2j],  u = y[m, 2j + 1]   (y the scaled tile above)
//
// Why one GEMM: the two-GEMM form it replaced (session 26) wrote the up projection (fp32 [M, I]) and
// read it back as the gate GEMM's C, 1.1 GB a layer at the 27B's 8,192 rows, and ran two mainloops
// over the same activations. v only: the divisor and the row absmax in this epilogue cost more than
// they save (H100, session 26: at M 8,192 the GEMM took 2.0-2.4 ms writing v, 3.1-3.5 with them),
// so `quantize_rows(v, s)` follows.
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

// What the epilogue adds after the scaling: nothing, the residual (C), or the SwiGLU of interleaved
// gate/up columns.
enum class Epi { kPlain, kResidual, kSwigluPairs };

// What the one-GEMM SwiGLU's store writes: out [M, N / 2] (row stride N / 2).
struct PairedOutput {
  float* out = nullptr;
};

// A visitor node of the one-GEMM SwiGLU over a tile whose even column 2j is a gate value and odd
// column 2j + 1 its up value. Store = false: v = silu(g) * u at the even column (`swiglu_value`,
// the Triton kernels' instructions, so the same bits) and 0 at the odd one. Store = true (the
// tree's root): the even columns written to out[m, j] from registers. Each thread checks the
// pairing it relies on (its fragment's neighbours are columns 2j and 2j + 1 of one row) and traps
// if a layout ever breaks it: a wrong pairing would be silently wrong numbers.
template <bool Store>
struct PairNode {
  struct SharedStorage {};
  using Arguments = PairedOutput;
  using Params = PairedOutput;
  using ElementAux = float;  // names the tree's output type where D is void (the root's)

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const&) {
    return get<1>(problem_shape) % 2 == 0;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  CUTLASS_HOST_DEVICE PairNode() {}
  CUTLASS_HOST_DEVICE PairNode(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(fusion::detail::ProducerLoadArgs<Args...> const&) {
    return fusion::detail::EmptyProducerLoadCallbacks{};
  }

  template <class Coords>
  struct ConsumerStoreCallbacks : fusion::detail::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Coords coords, int rows, int cols, Params const& params)
        : coords(coords), rows(rows), cols(cols), params(params) {}
    Coords coords;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N) -> (m, n, l) of the whole output
    int rows, cols;
    Params const& params;

    template <class ElementAccumulator, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const&, int epi_v, int epi_m,
                                                  int epi_n, cutlass::Array<float, F> const& x) {
      static_assert(F % 2 == 0, "a fragment holds whole (gate, up) pairs");
      Tensor at = coords(_, _, _, epi_m, epi_n);
      cutlass::Array<float, F> y;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < F; i += 2) {
        auto gate = at(epi_v * F + i);
        auto up = at(epi_v * F + i + 1);
        int row = get<0>(gate), col = get<1>(gate);
        if ((col & 1) != 0 || get<0>(up) != row || get<1>(up) != col + 1) __trap();
        bool inside = row < rows && col < cols;
        if constexpr (Store) {
          if (inside) params.out[static_cast<int64_t>(row) * (cols / 2) + col / 2] = x[i];
          y[i] = x[i];
          y[i + 1] = x[i + 1];
        } else {
          y[i] = inside ? swiglu_value(x[i], x[i + 1]) : 0.0f;
          y[i + 1] = 0.0f;
        }
      }
      return y;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    Tensor coords = fusion::detail::sm90_partition_for_epilogue<ReferenceSrc>(
        make_identity_tensor(make_shape(M, N, L)), args.tile_shape_mnk, args.tile_coord_mnkl, args.epi_tile,
        args.tiled_copy, args.thread_idx);
    return ConsumerStoreCallbacks<decltype(coords)>(coords, M, N, params);
  }
};

// The epilogue as a tree: w_scale[n] * (a_scale[m] * float(acc)) (+ residual, or paired into SwiGLU).
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
  // the one-GEMM SwiGLU: v paired up, then stored
  using Pairs = fusion::Sm90EVT<PairNode<true>, fusion::Sm90EVT<PairNode<false>, Scaled>>;
  using Op = cute::conditional_t<E == Epi::kPlain, Scaled,
                                 cute::conditional_t<E == Epi::kResidual, WithC<cutlass::plus>, Pairs>>;
};

// A [M, K] row-major (K contiguous), the weight [N, K] (K contiguous: column-major as K x N), y [M, N]
// row-major; 16-byte alignment: K % 16 == 0 and N % 4 == 0 (the caller checks).
// C (`c`: the residual) is read only by kResidual.
// Scheduler StreamK also takes its decomposition (DecompositionMode: 0 heuristic, 1 data-parallel,
// 2 split-K into Splits, 3 stream-K) and how partials meet (ReductionMode: 0 a turnstile in K order,
// 1 atomically in any order). The partials are the int32 accumulators, whose sum is exact in any
// grouping and order, so neither changes a bit.
template <class Tile, class Cluster, class MainloopSchedule, class EpilogueSchedule, class Scheduler, Epi E,
          int Swizzle = 1, int Raster = 0, int Splits = 1, int Decomposition = 0, int Reduction = 0>
struct Int8Gemm {
  using Row = cutlass::layout::RowMajor;
  using Col = cutlass::layout::ColumnMajor;
  static constexpr bool kPairs = E == Epi::kSwigluPairs;
  using ElementC = cute::conditional_t<E == Epi::kPlain || kPairs, void, float>;
  using ElementD = cute::conditional_t<kPairs, void, float>;  // the pairs' tree stores v itself
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, int32_t, float, ElementC, Row, 4, ElementD, Row, 4,
      EpilogueSchedule, typename ScaleTree<Tile, E>::Op>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, int8_t, Row, 16, int8_t, Col, 16, int32_t, Tile,
      Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // for kSwigluPairs (n the interleaved weight's rows) y is out [m, n / 2]
  static typename Gemm::Arguments arguments(const int8_t* a, const int8_t* w, const float* a_scale,
                                            const float* w_scale, const float* c, float* y, int m, int n,
                                            int k) {
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
                                  {{}, reinterpret_cast<const ElementC*>(c), stride_c,
                                   reinterpret_cast<ElementD*>(kPairs ? nullptr : y), stride_y},
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
    } else if constexpr (kPairs) {
      args.epilogue.thread = {{scaled, PairedOutput{}}, PairedOutput{y}};
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
                 const float* c, float* y, int m, int n, int k, void* workspace, cudaStream_t stream) {
    Gemm gemm;
    auto args = arguments(a, w, a_scale, w_scale, c, y, m, n, k);
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

// One config's C entry points: prism_int8_gemm_NAME (residual may be null), prism_int8_gemm_swiglu_pairs_NAME
// (the one-GEMM SwiGLU over the interleaved weight [2I, K]: v [m, I]) and the workspace size any of
// them needs.
#define PRISM_INT8_GEMM(NAME, TILE, CLUSTER, MAINLOOP, EPILOGUE, SCHEDULER, ORDER)                                \
  using NAME##_plain = prism::Int8Gemm<TILE, CLUSTER, MAINLOOP, EPILOGUE, SCHEDULER, prism::Epi::kPlain, ORDER>;       \
  using NAME##_residual = prism::Int8Gemm<TILE, CLUSTER, MAINLOOP, EPILOGUE, SCHEDULER, prism::Epi::kResidual, ORDER>; \
  using NAME##_pairs =                                                                                           \
      prism::Int8Gemm<TILE, CLUSTER, MAINLOOP, EPILOGUE, SCHEDULER, prism::Epi::kSwigluPairs, ORDER>;            \
  extern "C" size_t prism_int8_gemm_##NAME##_workspace(int m, int n, int k) {                                   \
    size_t a = NAME##_plain::workspace_bytes(m, n, k), b = NAME##_residual::workspace_bytes(m, n, k);           \
    size_t e = NAME##_pairs::workspace_bytes(m, n, k), ab = a > b ? a : b;                                       \
    return ab > e ? ab : e;                                                                                      \
  }                                                                                                              \
  extern "C" int prism_int8_gemm_##NAME(const int8_t* a, const int8_t* w, const float* a_scale,                 \
                                        const float* w_scale, const float* residual, float* y, int m, int n,     \
                                        int k, void* workspace, cudaStream_t stream) {                          \
    return residual ? NAME##_residual::run(a, w, a_scale, w_scale, residual, y, m, n, k, workspace, stream)     \
                    : NAME##_plain::run(a, w, a_scale, w_scale, residual, y, m, n, k, workspace, stream);       \
  }                                                                                                              \
  extern "C" int prism_int8_gemm_swiglu_pairs_##NAME(const int8_t* a, const int8_t* w, const float* a_scale,    \
                                                     const float* w_scale, float* v, int m, int n, int k,        \
                                                     void* workspace, cudaStream_t stream) {                     \
    return NAME##_pairs::run(a, w, a_scale, w_scale, nullptr, v, m, n, k, workspace, stream);                   \
  }
