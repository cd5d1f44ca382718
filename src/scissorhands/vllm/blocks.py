"""vLLM's paged K/V blocks on the CPU, read and written where each element lies.

vLLM keeps each layer's K/V in blocks of ``N`` tokens, ``kv_cache[num_blocks, H_kv, N, 2 * D]``; within a
(block, KV head) the first half holds K and the second V, in the layout of vLLM's CPU kernel for the machine and
dtype: "vec" (K transposed, ``[D, N]``, then V ``[N, D]``) or "amx" (bf16 on CPUs with AMX: tiles of 16 tokens).
Torch on vLLM's tensors; nothing here imports vLLM.
"""

from __future__ import annotations

import torch


def block_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K as (num_blocks, H_kv, D, N) and V as (num_blocks, H_kv, N, D): views of one layer's cache in the "vec"
    layout (K transposed in each block)."""
    nb, h, n, d2 = kv_cache.shape  # (num_blocks, H_kv, N, 2D)
    flat = kv_cache.view(nb, h, 2, n * (d2 // 2))
    return flat[:, :, 0].view(nb, h, d2 // 2, n), flat[:, :, 1].view(nb, h, n, d2 // 2)


def _amx_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's "amx" layout (2-byte K/V): K in groups of 16 tokens, each (D/2, 16, 2), pairs of dims per token;
    V in groups of 16 dims, each (N/2, 16, 2), pairs of tokens per dim."""
    nb, h, n, d2 = kv_cache.shape
    d = d2 // 2
    flat = kv_cache.view(nb, h, 2, n * d)
    return flat[:, :, 0].view(nb, h, n // 16, d // 2, 16, 2), flat[:, :, 1].view(nb, h, d // 16, n // 2, 16, 2)


def read_kv(kv_cache: torch.Tensor, layout: str, blocks, heads, offs) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the slots ``(blocks, heads, offs)`` (index tensors of one broadcast shape S): each S + (D,)."""
    if layout == "amx":
        k, v = _amx_views(kv_cache)
        return (k[blocks, heads, offs // 16, :, offs % 16, :].flatten(-2),
                v[blocks, heads, :, offs // 2, :, offs % 2].flatten(-2))
    keys_t, values = block_views(kv_cache)
    return keys_t[blocks, heads, :, offs], values[blocks, heads, offs, :]


def write_kv(kv_cache: torch.Tensor, layout: str, blocks, heads, offs, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write K and V (each S + (D,)) into the slots ``(blocks, heads, offs)``, as vLLM's cache update would."""
    if layout == "amx":
        kview, vview = _amx_views(kv_cache)
        kview[blocks, heads, offs // 16, :, offs % 16, :] = k.unflatten(-1, (-1, 2)).to(kview.dtype)
        vview[blocks, heads, :, offs // 2, :, offs % 2] = v.unflatten(-1, (-1, 16)).to(vview.dtype)
        return
    keys_t, values = block_views(kv_cache)
    keys_t[blocks, heads, :, offs] = k.to(keys_t.dtype)
    values[blocks, heads, offs, :] = v.to(values.dtype)


def copy_slots(kv_cache: torch.Tensor, layout: str, src: torch.Tensor, dst: torch.Tensor, heads: torch.Tensor,
               block: int) -> None:
    """Copy K/V of KV head ``heads[i]`` from physical slot ``src[i]`` to ``dst[i]`` (all (M,)); reads come first."""
    k, v = read_kv(kv_cache, layout, src // block, heads, src % block)
    write_kv(kv_cache, layout, dst // block, heads, dst % block, k, v)


def phys(table_row: torch.Tensor, positions: torch.Tensor, block: int) -> torch.Tensor:
    """Physical slots of logical ``positions`` (any shape) through one request's block table."""
    return table_row.long()[positions // block] * block + positions % block
