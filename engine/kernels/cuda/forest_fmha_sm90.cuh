// The long attention tier's own causal block on Hopper: CUTLASS's FMHA example kernel (examples/
// 88_hopper_fmha in the nvidia-cutlass wheel: one TMA producer warp group, two consumer warp groups
// on 64 query rows each, wgmma for q k^T and p v, an online softmax in registers), reached through
// two parts of ours and nothing of it copied:
//
// - `TileListScheduler`: the kernel asks its tile scheduler for each CTA's block coordinate
//   (query tile, 0, (batch, head)). Ours reads it from a device-side list the engine's plan kernel
//   writes (`forest_attention._fmha_plan_kernel`): (segment-local 128-row tile, the segment's first
//   packed row, its length). One launch serves every query head: the batch coordinate is that
//   packed row times the KV heads plus the CTA's KV head, and the head coordinate its query head's
//   place in the KV head's group. With K/V laid out [rows, NKV, 256] and Q [rows, NH, 256], a batch
//   stride of 256 elements for K/V and of a group's G * 256 for Q then puts every TMA tile the
//   collective loads - Q rows m*128.., keys from 0 - at the segment's own rows of the right heads,
//   starting at its first token (the sequence strides are a packed row's, NKV * 256 and NH * 256);
//   the causal mask and the key loop's trip count (CausalFusion, positions relative to the tile
//   coordinates) are the segment's own. One captured graph serves every forest of a bucket: the
//   grid is the list's capacity times the heads, and a CTA past the list's count does nothing.
// - `RowMaskedEpilogue`: the example's epilogue stores O through TMA in the operand type, a whole
//   tile, which would write a tail tile's rows past the segment onto the next segment's. Ours
//   stores the normalised output in fp32 and the log-sum-exp straight from registers, only for
//   rows inside the segment (its length from the same list entry), into the engine's output and a
//   [rows, heads] LSE buffer; the Triton fold kernel then adds the ancestors and the gate.
//
// Why a segment's bits cannot depend on its neighbours: its queries' tiles read only its own rows
// (rows past its end are other segments' or padding, and their outputs are never stored); a key
// past a query's causal limit is set to -inf before the softmax (assignment, so whatever that key
// holds is gone) and its probability is an exact 0, and the values the caller zero-pads are finite,
// so 0 * v adds exactly nothing to the p v products. GQA: the KV head in the batch coordinate (above),
// its G query heads the head mode (stride one head for Q, 0 for K/V).
//
// Requirements the caller (`engine/kernels/forest_attention.py`) checks: bf16 Q [rows + 128, NH,
// 256] and K/V [rows + 128, NKV, 256] (a tail tile reads up to 127 rows past the last row, and K/V's
// padding rows must be finite), fp32 out [rows, NH * 256], fp32 lse [rows, NH].
#pragma once

#include <cstdint>
#include <mutex>
#include <set>

#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "collective/fmha_collective_tma_warpspecialized.hpp"
#include "collective/fmha_epilogue.hpp"
#include "collective/fmha_fusion.hpp"
#include "device/device_universal.hpp"
#include "kernel/fmha_kernel_tma_warpspecialized.hpp"

namespace prism::fmha {
using namespace cute;

// One entry of the work list: a 128-row query tile of one long segment.
struct Tile {
  int32_t m;       // segment-local tile index (rows m * 128 ..)
  int32_t row;     // the segment's first packed row
  int32_t length;  // the segment's tokens
  int32_t unused;  // 16-byte entries
};

struct TileListScheduler {
  struct Params {
    Tile const* tiles = nullptr;
    int32_t const* count = nullptr;
    int capacity = 0;
    int heads = 0;     // query heads (the grid's)
    int kv_heads = 1;  // KV heads: query head h reads KV head h / (heads / kv_heads)
  };

  Params params;
  bool valid_;

  CUTLASS_DEVICE explicit TileListScheduler(Params const& p)
      : params(p), valid_(int(blockIdx.x) < *p.count) {}

  // The list lives on the device; the caller fills every field after this.
  template <class ProblemSize, class ClusterShape, class TileShape>
  static Params to_underlying_arguments(ProblemSize const&, cutlass::KernelHardwareInfo, ClusterShape const&,
                                        TileShape const&) {
    return Params{};
  }

  // (list entry, query head): one head's whole list, last tile (the longest causal walk) first, then
  // the next head's
  static dim3 get_grid_shape(Params const& p) { return dim3(p.capacity, p.heads, 1); }

  CUTLASS_DEVICE bool is_valid() { return valid_; }

  // (query tile, 0, (packed row * NKV + KV head, the query head's place in its group))
  CUTLASS_DEVICE auto get_block_coord() {
    Tile t = params.tiles[blockIdx.x];
    int const group = params.heads / params.kv_heads;
    int const head = int(blockIdx.y);
    return make_coord(t.m, _0{}, make_coord(t.row * params.kv_heads + head / group, head % group));
  }

  CUTLASS_DEVICE TileListScheduler& operator++() {
    valid_ = false;  // one tile a CTA
    return *this;
  }
};

template <class Element, class TileShapeWG>
struct RowMaskedEpilogue {
  // The pipeline and storage types the kernel declares for its epilogue: the example's (unused).
  using Base = cutlass::fmha::collective::FmhaFwdEpilogue<Element, float, TileShapeWG>;
  using TensorStorage = typename Base::TensorStorage;
  using PipelineStorage = typename Base::PipelineStorage;
  using LoadPipeline = typename Base::LoadPipeline;
  static constexpr int TmaTransactionBytes = Base::TmaTransactionBytes;

  struct Arguments {
    float* out = nullptr;       // [rows, NH * HD] fp32
    int64_t out_row = 0;        // elements between rows
    float* lse = nullptr;       // [rows, NH] fp32
    int64_t lse_row = 0;        // elements between rows
    Tile const* tiles = nullptr;  // the scheduler's list (a row's segment length)
    int kv_heads = 1;             // the scheduler's batch coordinate: packed row * kv_heads + KV head
    int group = 1;                // query heads per KV head
  };
  using Params = Arguments;

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void* = nullptr) {
    return args;
  }

  template <class TileShape, class BlkCoord, class ResultTuple, class TiledMma, class ProblemShape>
  CUTLASS_DEVICE void operator()(TileShape const& tile_shape, BlkCoord const& wg_coord, ResultTuple const& result,
                                 TiledMma const& tiled_mma, ProblemShape const&, Params const& params,
                                 LoadPipeline, TensorStorage&) {
    using cutlass::fmha::collective::layout_acc_mn;
    auto acc = get<0>(result);  // the normalised output, fp32
    auto lse = get<1>(result);  // natural log-sum-exp of the scaled scores
    auto thr_mma = tiled_mma.get_thread_slice(threadIdx.x % cutlass::NumThreadsPerWarpGroup);
    Tensor coords = thr_mma.partition_C(make_identity_tensor(take<0, 2>(tile_shape)));
    Tensor acc_mn = make_tensor(acc.data(), layout_acc_mn(tiled_mma, acc.layout()));
    Tensor coords_mn = make_tensor(coords.data(), layout_acc_mn(tiled_mma, coords.layout()));
    // this warp group's rows: the scheduler's tile times the warp groups, plus its own index
    int const first = get<0>(wg_coord) * int(get<0>(tile_shape));
    int const batch = get<0>(get<2>(wg_coord));  // packed row * NKV + KV head
    int const row0 = batch / params.kv_heads;
    int const head = (batch % params.kv_heads) * params.group + get<1>(get<2>(wg_coord));
    int const length = params.tiles[blockIdx.x].length;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size<0>(acc_mn); ++i) {
      int const local = first + int(get<0>(coords_mn(i, 0)));
      if (local >= length) continue;
      int64_t const row = int64_t(row0) + local;
      float* o = params.out + row * params.out_row + int64_t(head) * int(get<1>(tile_shape));
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < size<1>(acc_mn); ++j) {
        o[get<1>(coords_mn(i, j))] = acc_mn(i, j);
      }
      if (get<1>(coords_mn(i, 0)) == 0) {
        params.lse[row * params.lse_row + head] = lse(i);
      }
    }
  }
};

using Element = cutlass::bfloat16_t;
constexpr int kHeadDim = 256;
constexpr int kTileRows = 128;
using TileShape = Shape<_128, _64, Int<kHeadDim>>;  // query rows, keys a step, head dim
using Stride3 = cute::tuple<int, _1, cute::tuple<int, int>>;
using Mainloop = cutlass::fmha::collective::FmhaMainloopTmaWarpSpecialized<
    Element, float, float, TileShape, Stride3, Stride3, Stride3, cutlass::fmha::collective::CausalFusion>;
using Epilogue = RowMaskedEpilogue<Element, typename Mainloop::TileShapePV>;
using Kernel = cutlass::fmha::kernel::FmhaKernelTmaWarpSpecialized<Mainloop, Epilogue, TileListScheduler>;
using Operator = cutlass::device::Universal<Kernel>;

}  // namespace prism::fmha

// One call, one launch over the list for every head. q bf16 [rows + 128, nh, 256]; k, v bf16
// [kv_rows, nkv, 256] (kv_rows >= rows + 128); out fp32 [rows, nh * 256]; lse fp32 [rows, nh];
// tiles [capacity] and count [1] from the plan kernel. Returns 0, or a nonzero CUTLASS status.
extern "C" int prism_forest_fmha(const void* q, const void* k, const void* v, float* out, float* lse,
                                 const void* tiles, const int32_t* count, int capacity, int rows,
                                 int kv_rows, int num_heads, int num_kv_heads, cudaStream_t stream) {
  using namespace prism::fmha;
  int const group = num_heads / num_kv_heads;
  if (capacity <= 0 || rows <= 0) return 0;
  if (num_kv_heads < 1 || num_heads % num_kv_heads || kv_rows < rows + kTileRows) return 1;
  // the problem: batch = packed rows x KV heads, heads = a KV head's query heads, and query and key
  // extents of a whole padded call (every segment-local tile lies inside them; the causal walk, not
  // the extent, bounds the key loop)
  int const extent = (rows + kTileRows + 7) / 8 * 8;
  // the kernel's shared memory is above the 48 KB a launch gets unasked: the attribute is set once
  // per device (it is a property of the function on the current device, and one process may
  // launch on several), under a lock (callers may come from several threads)
  {
    static std::mutex lock;
    static std::set<int> configured;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess) return 2;
    std::lock_guard<std::mutex> held(lock);
    if (!configured.count(device)) {
      if (cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               Kernel::SharedStorageSize) != cudaSuccess) {
        return 2;
      }
      configured.insert(device);
    }
  }
  auto const* list = static_cast<prism::fmha::Tile const*>(tiles);
  int const q_row = num_heads * kHeadDim;
  int const kv_row = num_kv_heads * kHeadDim;
  Stride3 dq = make_stride(q_row, _1{}, make_stride(group * kHeadDim, kHeadDim));
  Stride3 dkv = make_stride(kv_row, _1{}, make_stride(kHeadDim, 0));
  typename Kernel::Arguments args{
      make_tuple(rows * num_kv_heads, group, extent, extent, kHeadDim),
      {static_cast<Element const*>(q), dq, static_cast<Element const*>(k), dkv, static_cast<Element const*>(v), dkv},
      {out, q_row, lse, num_heads, list, num_kv_heads, group},
      cutlass::KernelHardwareInfo{}};
  if (!Kernel::can_implement(args)) return 3;
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);
  params.tile_scheduler.tiles = list;
  params.tile_scheduler.count = count;
  params.tile_scheduler.capacity = capacity;
  params.tile_scheduler.heads = num_heads;
  params.tile_scheduler.kv_heads = num_kv_heads;
  if (Operator::run(params, stream) != cutlass::Status::kSuccess) return 4;
  return 0;
}
