"""The Qwen3.5 vision tower: an image's patches -> one embedding per merged token (text hidden size).

Written to be read next to transformers' `Qwen3_5VisionModel`:

- patch embedding: the Conv3d with stride = kernel is one matmul of each flattened patch
  (3 channels x 2 time steps x p x p) with the flattened kernel, plus its bias;
- absolute positions: the learned square grid, resampled bilinearly (corners aligned) to the
  image's patch grid and added, in the same merge-block order as the patches;
- blocks: pre-LayerNorm attention over all of the image's patches (not causal), q and k rotated
  by 2-D rotary positions (the first half of each head's frequencies turn with the patch row,
  the second half with the column), then a pre-LayerNorm MLP with tanh GELU;
- merger: LayerNorm, the 2x2 neighbouring patches concatenated, Linear - exact GELU - Linear.

Each image runs on its own (attention never crosses images, and its shapes depend on the image
alone), so an image's embeddings are the same bits whatever else is in the request, the batch
or the cache: the int8 text path's invariance holds with images. The tower itself stays fp32 on
every precision path (it is a few percent of a request's work at the sizes served).

On the CPU the tower runs with one intra-op thread, whatever the process's setting: a CPU BLAS
may split a matmul's sum by the thread count (seen on an AMX Xeon at 2 threads), and a
replay on a machine with another core count must decide the same. `_CPU_TOWER` serializes the
CPU towers of a process, so no other tower changes the count in between.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from engine.vision.mmproj import VisionConfig, VisionWeights
from engine.vision.preprocess import PreparedImage


def block_order_coords(grid_h: int, grid_w: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of every patch in merge-block order (the order the patches arrive in)."""
    rows = torch.arange(grid_h).view(grid_h // merge, 1, merge, 1).expand(-1, grid_w // merge, -1, merge)
    cols = torch.arange(grid_w).view(1, grid_w // merge, 1, merge).expand(grid_h // merge, -1, merge, -1)
    return rows.reshape(-1), cols.reshape(-1)


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bilinear taps (corners aligned) of target indices on an axis of `size` into `side` sources."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    lo = torch.floor(src)
    frac = src - lo
    lo_i = lo.long().clamp(0, side - 1)
    hi_i = (lo.long() + 1).clamp(0, side - 1)
    return lo_i, hi_i, frac


def position_embeddings(weights: VisionWeights, grid_h: int, grid_w: int) -> torch.Tensor:
    """The learned position grid resampled to (grid_h, grid_w), in merge-block order [N, hidden]."""
    c = weights.config
    side = c.grid_side
    rows, cols = block_order_coords(grid_h, grid_w, c.spatial_merge_size)
    r0, r1, fr = _axis_taps(rows, grid_h, side)
    c0, c1, fc = _axis_taps(cols, grid_w, side)
    table = weights.pos_embd
    dev = table.device
    taps = [
        (r0, c0, (1 - fr) * (1 - fc)),
        (r0, c1, (1 - fr) * fc),
        (r1, c0, fr * (1 - fc)),
        (r1, c1, fr * fc),
    ]
    out = torch.zeros(rows.numel(), c.hidden_size, dtype=torch.float32, device=dev)
    for r, col, w in taps:
        out = out + table[(r * side + col).to(dev)] * w.to(dev)[:, None]
    return out


def rotary(
    config: VisionConfig, grid_h: int, grid_w: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] of the 2-D rotary positions, in merge-block order."""
    quarter = config.head_dim // 4
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32) / (2 * quarter))
    )
    rows, cols = block_order_coords(grid_h, grid_w, config.spatial_merge_size)
    angles = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
    angles = torch.cat([angles, angles], dim=-1).to(device)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + turned * sin[:, None, :]


def _block(
    config: VisionConfig, b: dict[str, torch.Tensor], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    n, eps = h.shape[0], config.layer_norm_eps
    heads, hd = config.num_heads, config.head_dim
    x = F.layer_norm(h, (config.hidden_size,), b["ln1_w"], b["ln1_b"], eps)
    qkv = F.linear(x, b["attn_qkv_w"], b["attn_qkv_b"]).view(n, 3, heads, hd)
    q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
    # one head at a time: a 2 MP image has 8,192 patches, and all heads' scores at once would be
    # heads x 8,192^2 floats (4 GiB at 16 heads); one head's are 256 MiB
    attn = torch.empty(n, heads, hd, dtype=h.dtype, device=h.device)
    for j in range(heads):
        scores = (q[:, j] @ k[:, j].T) * hd**-0.5
        attn[:, j] = torch.softmax(scores, dim=-1) @ v[:, j]
    attn = attn.reshape(n, heads * hd)
    h = h + F.linear(attn, b["attn_out_w"], b["attn_out_b"])
    x = F.layer_norm(h, (config.hidden_size,), b["ln2_w"], b["ln2_b"], eps)
    x = F.gelu(F.linear(x, b["ffn_up_w"], b["ffn_up_b"]), approximate="tanh")
    return h + F.linear(x, b["ffn_down_w"], b["ffn_down_b"])


_CPU_TOWER = threading.Lock()


@contextlib.contextmanager
def _one_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """One intra-op thread for the tower's CPU ops (see the module docstring); CUDA: nothing."""
    if device.type != "cpu":
        yield
        return
    with _CPU_TOWER:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def encode_image(weights: VisionWeights, image: PreparedImage) -> torch.Tensor:
    """Embeddings [image.tokens, out_hidden] float32 of one image, on the weights' device."""
    with _one_thread_on_cpu(weights.pos_embd.device):
        return _encode_image(weights, image)


@torch.no_grad()
def _encode_image(weights: VisionWeights, image: PreparedImage) -> torch.Tensor:
    c = weights.config
    dev = weights.pos_embd.device
    if image.pixels.shape != (image.grid_h * image.grid_w, c.patch_dim):
        raise ValueError(f"patches {tuple(image.pixels.shape)} do not fit grid {image.grid_h}x{image.grid_w}")
    kernel = weights.patch_embd.reshape(c.hidden_size, -1)
    h = image.pixels.to(dev, torch.float32) @ kernel.T + weights.patch_bias
    h = h + position_embeddings(weights, image.grid_h, image.grid_w)
    cos, sin = rotary(c, image.grid_h, image.grid_w, dev)
    for b in weights.blocks:
        h = _block(c, b, h, cos, sin)
    h = F.layer_norm(h, (c.hidden_size,), weights.post_ln_w, weights.post_ln_b, c.layer_norm_eps)
    merged = h.reshape(-1, c.hidden_size * c.spatial_merge_size**2)
    x = F.gelu(F.linear(merged, weights.mm0_w, weights.mm0_b))
    return F.linear(x, weights.mm2_w, weights.mm2_b)
