// int8 x int8 GEMM on Hopper's tensor cores (TMA loads, warp-specialized wgmma) through CUTLASS 3,
// with the engine's exact epilogue in its epilogue visitor tree:
//
//     y[m, n] = (float(acc[m, n]) * a_scale[m]) * w_scale[n]   (+ residual[m, n]),   fp32
//
// acc is the exact int32 sum of a[m, :] * w[n, :] (|acc| <= K * 127^2 < 2^31), so no tile shape,
// schedule or split can change it; the epilogue is three IEEE operations in that order (the file is
// compiled with -fmad=false, so the add is never contracted with the multiply): y equals the Triton
// kernel's and the torch reference's bit for bit. engine/kernels/cutlass_gemm.py writes one
// translation unit per config (PRISM_INT8_GEMM below), builds them into one shared library and
// calls it through ctypes.
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

// The epilogue as a tree: w_scale[n] * (a_scale[m] * float(acc)) (+ residual). Multiplication
// commutes exactly in IEEE arithmetic, so these are the reference's (acc * a_scale) * w_scale bits.
template <class Tile, bool Residual>
struct ScaleTree {
  using RowScaled = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                                    fusion::Sm90ColBroadcast<0, Tile, float, float, Stride<_1, _0, int64_t>>,
                                    fusion::Sm90AccFetch>;
  using Scaled = fusion::Sm90EVT<fusion::Sm90Compute<cutlass::multiplies, float, float, kRound>,
                                 fusion::Sm90RowBroadcast<0, Tile, float, float, Stride<_0, _1, int64_t>>,
                                 RowScaled>;
  using Op = cute::conditional_t<
      Residual,
      fusion::Sm90EVT<fusion::Sm90Compute<cutlass::plus, float, float, kRound>, Scaled, fusion::Sm90SrcFetch<float>>,
      Scaled>;
};

// A [M, K] row-major (K contiguous), the weight [N, K] (K contiguous: column-major as K x N), y [M, N]
// row-major; 16-byte alignment: K % 16 == 0 and N % 4 == 0 (the caller checks).
template <class Tile, class Cluster, class MainloopSchedule, class EpilogueSchedule, class Scheduler, bool Residual>
struct Int8Gemm {
  using Row = cutlass::layout::RowMajor;
  using Col = cutlass::layout::ColumnMajor;
  using ElementC = cute::conditional_t<Residual, float, void>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, int32_t, float, ElementC, Row, 4, float, Row, 4,
      EpilogueSchedule, typename ScaleTree<Tile, Residual>::Op>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, int8_t, Row, 16, int8_t, Col, 16, int32_t, Tile,
      Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(const int8_t* a, const int8_t* w, const float* a_scale,
                                            const float* w_scale, const float* residual, float* y, int m, int n,
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
                                  {{}, reinterpret_cast<const ElementC*>(residual), stride_c, y, stride_y},
                                  hw};
    typename ScaleTree<Tile, Residual>::RowScaled::Arguments row_scaled{{a_scale}, {}, {}};
    typename ScaleTree<Tile, Residual>::Scaled::Arguments scaled{{w_scale}, row_scaled, {}};
    if constexpr (Residual) {
      args.epilogue.thread = {scaled, {}, {}};
    } else {
      args.epilogue.thread = scaled;
    }
    return args;
  }

  static size_t workspace_bytes(int m, int n, int k) {
    return Gemm::get_workspace_size(arguments(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k));
  }

  // 0 launched; 1 shape not implementable; 2 initialize failed; 3 launch failed.
  static int run(const int8_t* a, const int8_t* w, const float* a_scale, const float* w_scale,
                 const float* residual, float* y, int m, int n, int k, void* workspace, cudaStream_t stream) {
    Gemm gemm;
    auto args = arguments(a, w, a_scale, w_scale, residual, y, m, n, k);
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

// Keeps a template's commas inside one macro argument.
#define PRISM_ARG(...) __VA_ARGS__

// One config's two C entry points: prism_int8_gemm_NAME (residual may be null) and its workspace size.
#define PRISM_INT8_GEMM(NAME, TILE, CLUSTER, MAINLOOP, EPILOGUE, SCHEDULER)                                      \
  using NAME##_plain = prism::Int8Gemm<TILE, CLUSTER, MAINLOOP, EPILOGUE, SCHEDULER, false>;                    \
  using NAME##_residual = prism::Int8Gemm<TILE, CLUSTER, MAINLOOP, EPILOGUE, SCHEDULER, true>;                  \
  extern "C" size_t prism_int8_gemm_##NAME##_workspace(int m, int n, int k) {                                   \
    size_t a = NAME##_plain::workspace_bytes(m, n, k), b = NAME##_residual::workspace_bytes(m, n, k);           \
    return a > b ? a : b;                                                                                        \
  }                                                                                                              \
  extern "C" int prism_int8_gemm_##NAME(const int8_t* a, const int8_t* w, const float* a_scale,                 \
                                        const float* w_scale, const float* residual, float* y, int m, int n,     \
                                        int k, void* workspace, cudaStream_t stream) {                          \
    return residual ? NAME##_residual::run(a, w, a_scale, w_scale, residual, y, m, n, k, workspace, stream)     \
                    : NAME##_plain::run(a, w, a_scale, w_scale, residual, y, m, n, k, workspace, stream);       \
  }
