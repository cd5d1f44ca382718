"""One attention layer's eviction state for every sequence vLLM runs, over vLLM's paged K/V blocks.

vLLM keeps each layer's K/V in blocks of ``N`` tokens,
``kv_cache[num_blocks, H_kv, N, 2 * D]``; within a (block, KV head) the first
half is K transposed (``[D, N]``) and the second V (``[N, D]``), on the CPU
kernels this adapter supports (:func:`block_views`). The plugin presents a
budgeted layer to vLLM as a sliding window of ``B`` slots (the budget), so
vLLM's own block manager frees every block that falls behind the window and the
kernel attends the ``B`` logical slots ``(p - B, p]`` of a query at position
``p``. What this module adds is *which tokens live in those slots*:

* each sequence is a row of one :class:`~scissorhands.core.budgeted.BudgetedKV`
  (the core's selection, method, importance state and protection, unchanged);
  its store is :class:`PagedSlots`, which records where in vLLM's blocks each
  stored token's K/V is (vLLM has already written the bytes);
* a new sequence's prompt is attended exactly by the core
  (:func:`scissorhands.core.streaming.attend`, the prompt-aware prefill) in a
  one-row layer, which gives its output, its importance and the ``B`` kept
  tokens; those are moved into the window's slots and the row joins the batch;
* after each decode step, a full row drops its least important token (the
  core's ``compress``) and, if the token in the slot that leaves the window next
  is kept, its K/V are copied over the dropped token's slot. The window then
  holds the ``B - 1`` kept tokens and room for the next one: exactly what the
  transformers cache stores, because keys are stored after rotary embedding and
  a token's position goes with it, not with its slot.

Nothing here imports vLLM: it is torch on vLLM's tensors, and is tested on
tensors of the same layout without an engine.
"""

from __future__ import annotations

import torch

from scissorhands.core.budgeted import BudgetedKV
from scissorhands.core.prefill import make_prefill
from scissorhands.core.stores.base import DenseKVStore, KVStore, gather_rows
from scissorhands.core.streaming import attend

from .settings import PluginSettings


def block_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K as (num_blocks, H_kv, D, N) and V as (num_blocks, H_kv, N, D): views of one layer's cache."""
    nb, h, n, d2 = kv_cache.shape  # (num_blocks, H_kv, N, 2D)
    flat = kv_cache.view(nb, h, 2, n * (d2 // 2))
    return flat[:, :, 0].view(nb, h, d2 // 2, n), flat[:, :, 1].view(nb, h, n, d2 // 2)


def gather_keys(keys_t: torch.Tensor, where: torch.Tensor, block: int) -> torch.Tensor:
    """K at physical slots ``where`` (R, H_kv, L): (R, H_kv, L, D)."""
    heads = torch.arange(where.shape[1], device=where.device)[None, :, None]  # (1, H_kv, 1)
    return keys_t[where // block, heads, :, where % block]


def gather_kv(keys_t: torch.Tensor, values: torch.Tensor, where: torch.Tensor, block: int):
    """K and V at physical slots ``where`` (R, H_kv, L): each (R, H_kv, L, D)."""
    heads = torch.arange(where.shape[1], device=where.device)[None, :, None]  # (1, H_kv, 1)
    return gather_keys(keys_t, where, block), values[where // block, heads, where % block, :]


def copy_slots(keys_t: torch.Tensor, values: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
               heads: torch.Tensor, block: int) -> None:
    """Copy K/V of KV head ``heads[i]`` from physical slot ``src[i]`` to ``dst[i]`` (all (M,))."""
    sb, so, db, do = src // block, src % block, dst // block, dst % block
    keys_t[db, heads, :, do] = keys_t[sb, heads, :, so]
    values[db, heads, do, :] = values[sb, heads, so, :]


class PagedSlots(KVStore):
    """Where each stored token's K/V lives in vLLM's blocks: physical slot ids (R, H_kv, capacity), int64.

    vLLM writes the bytes; the layer "writes" a token here by handing its slot id in place of its key (shaped
    like a key with one channel), and an eviction permutes the ids with the same index as everything else.
    Reads gather the K/V from the blocks of the current step (:attr:`cache`).
    """

    name = "paged"

    def __init__(self):
        self.where = torch.zeros(0, 0, 0, dtype=torch.long)
        self.cache: tuple[torch.Tensor, torch.Tensor, int] | None = None  # (K^T, V, block size) of this step

    @property
    def capacity(self) -> int:
        return self.where.shape[-1]

    def allocate(self, key, value) -> None:
        self.where = torch.zeros(key.shape[0], key.shape[1], 0, dtype=torch.long, device=key.device)

    def reset(self) -> None:
        self.where = torch.zeros(0, 0, 0, dtype=torch.long)

    def resize(self, capacity: int) -> None:
        out = self.where.new_zeros(*self.where.shape[:2], capacity)
        keep = min(capacity, self.capacity)
        out[:, :, :keep] = self.where[:, :, :keep]
        self.where = out

    def write(self, start: int, key, value) -> None:
        self.where[:, :, start : start + key.shape[2]] = key[..., 0]

    def write_at(self, rows, slots, key, value) -> None:
        self.where[rows, :, slots] = key[..., 0]  # key: (N, H_kv, 1) slot ids

    def reorder(self, order, rows=None) -> None:
        gather_rows(self.where, order, rows)

    def read(self, length: int):
        if self.cache is None:
            raise RuntimeError("PagedSlots: read outside an engine step")
        keys_t, values, block = self.cache
        return gather_kv(keys_t, values, self.where[:, :, :length], block)

    def select_batch(self, index) -> None:
        self.where = self.where.index_select(0, index)

    def nbytes(self) -> int:
        return 0  # the K/V are vLLM's blocks; the ids are bookkeeping (positions_bytes-like)

    def bytes_per_token_head(self) -> int:
        return 0 if self.cache is None else 2 * self.cache[1].shape[-1] * self.cache[1].element_size()

    def dense_bytes_per_token_head(self, dtype=None) -> int:
        return self.bytes_per_token_head()


class PagedLayer:
    """One layer's eviction state for up to ``rows`` sequences at once, each a row of one ``BudgetedKV``.

    Parameters
    ----------
    settings : PluginSettings
    layer_idx : int
    num_heads, num_kv_heads, head_size : int
    scale : float
        Logit scale.
    softcap : float or None
    rows : int
        Most sequences at once (vLLM's ``max_num_seqs``).

    Notes
    -----
    The row pool starts with one row and doubles when a new sequence finds none free, up to ``rows``. Every row
    costs importance state (``n_buckets`` floats per slot and KV head) and takes part in each step's scoring,
    so the pool follows the most sequences that ran at once, not the most vLLM would allow (by default 256 for
    ``LLM`` and 128 for the server on CPUs, up to 1,024 on large GPUs).
    """

    def __init__(self, settings: PluginSettings, layer_idx: int, num_heads: int, num_kv_heads: int, head_size: int,
                 scale: float, softcap: float | None, rows: int):
        self.settings = settings
        config = settings.config
        self.budget = config.budget
        self.recent = config.recent_for(self.budget)
        self.layer_idx, self.scale, self.softcap = layer_idx, scale, softcap
        self.heads, self.kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.group = num_heads // num_kv_heads
        self.method = settings.method()
        self.kv = self._budgeted(PagedSlots())
        template = torch.zeros(1, num_kv_heads, 0, 1, dtype=torch.long)
        self.kv.allocate(template, template)
        self.kv.resize(self.budget)
        for state in self.kv.states:
            state.allocate(1, num_kv_heads, self.budget, group=self.group, device="cpu", dtype=torch.float32)
        self.kv.states_ready = True
        self.store: PagedSlots = self.kv.store  # type: ignore[assignment]
        self.most_rows = rows
        self.row_of: dict[str, int] = {}
        self.free_rows = [0]
        self.restarts = 0  # sequences begun again (a preempted request is recomputed from its first token)

    def _budgeted(self, store: KVStore, prefill=None) -> BudgetedKV:
        c = self.settings.config
        return BudgetedKV(self.budget, self.recent, c.drop_for(self.budget), self.method, self.method.make_state(c),
                          self.layer_idx, store, sinks=c.sinks, prefill=prefill,
                          protect=self.settings.protection())

    # -- rows ----------------------------------------------------------------------------------------------
    def release(self, request_ids) -> None:
        """Finished (or aborted) requests give their rows back."""
        for rid in request_ids:
            row = self.row_of.pop(rid, None)
            if row is not None:
                self.free_rows.append(row)

    def _new_row(self, rid: str) -> int:
        row = self.row_of.get(rid)  # a preempted request starts again from its first token
        if row is not None:
            self.restarts += 1
        else:
            if not self.free_rows:
                self._grow()
            row = self.row_of[rid] = self.free_rows.pop()
        return row

    def _grow(self) -> None:
        """Double the row pool, up to ``most_rows``. A new row holds a copy of row 0 until a prompt loads it, as a
        released row keeps its last sequence's state: nothing a row holds while no sequence runs in it is used."""
        n = self.kv.slots.lengths.shape[0]
        grown = min(2 * n, self.most_rows)
        if grown == n:
            raise RuntimeError("scissorhands: more running sequences than rows (max_num_seqs)")
        self.kv.select_batch(torch.cat([torch.arange(n), torch.zeros(grown - n, dtype=torch.long)]))
        self.free_rows.extend(range(grown - 1, n - 1, -1))

    # -- one engine step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, request_ids: list[str], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             kv_cache: torch.Tensor, query_start: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
             slot_mapping: torch.Tensor, output: torch.Tensor) -> None:
        """Account for one step of this layer, after vLLM's kernel wrote ``output``; fix the prompts' outputs.

        query (T, H_q, D), key/value (T, H_kv, D) of the step's tokens, rows in ``request_ids`` order;
        ``query_start`` (R + 1,), ``seq_lens`` (R,), ``block_table`` (R, blocks), ``slot_mapping`` (T,).
        """
        keys_t, values = block_views(kv_cache)
        block = kv_cache.shape[2]
        self.store.cache = (keys_t, values, block)
        starts = query_start.tolist()
        lengths = seq_lens.tolist()
        decode: list[tuple[int, int]] = []  # (pool row, token index)
        full: list[tuple[int, int]] = []  # (batch row, pool row): rows at their budget after this step
        for i, rid in enumerate(request_ids):
            a, b, total = starts[i], starts[i + 1], lengths[i]
            if b == a:
                continue
            if b - a == total:  # the sequence's first chunk: a new request, or a preempted one again
                row = self._new_row(rid)
                self._prefill(row, i, query[a:b], key[a:b], value[a:b], block_table, block, output[a:b])
            elif b - a == 1 and rid in self.row_of:
                row = self.row_of[rid]
                decode.append((row, a))
            else:
                raise RuntimeError("scissorhands: a prompt came in chunks; the plugin turns chunked prefill off")
            if total >= self.budget:
                full.append((i, row))
        if decode:
            self._decode(decode, query, slot_mapping)
        if full:
            self._prepare_next(full, block_table, block)
        self.store.cache = None

    def _prefill(self, row: int, i: int, q, k, v, block_table, block: int, out) -> None:
        """Attend a prompt exactly, evict it to the budget, and move the kept tokens into the window."""
        t = q.shape[0]
        one = self._budgeted(DenseKVStore(), make_prefill(self.settings.config))
        k4, v4 = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, H_kv, T, D)
        one.allocate(k4, v4)
        ctx = attend(one, q.transpose(0, 1)[None], k4, v4, None, self.scale, self.softcap,
                     self.settings.config.query_tile)  # (1, H_q, T, D)
        out.copy_(ctx[0].transpose(0, 1).reshape(out.shape).to(out.dtype))
        length = int(one.slots.lengths[0])
        kept = one.slots.positions[0, :, :length].long()  # (H_kv, L), ascending
        where = self._phys(block_table[i], kept, block)
        if length < t:  # kept tokens before the window move into the slots of the window's evicted ones
            keys_t, values, _ = self.store.cache  # type: ignore[misc]
            window = torch.arange(t - length, t)
            for h in range(self.kv_heads):
                outside = kept[h] < t - length
                if not bool(outside.any()):
                    continue
                holes = window[~torch.isin(window, kept[h])]  # (n,) ascending, as many as tokens outside
                dst = self._phys(block_table[i], holes, block)
                copy_slots(keys_t, values, where[h, outside], dst, torch.full_like(dst, h), block)
                where[h, outside] = dst
        self.kv.slots.load_row(row, kept, t)
        for mine, theirs in zip(self.kv.states, one.states):
            mine.load_row(row, theirs, 0, length)
        self.store.where[row] = 0
        self.store.where[row, :, :length] = where

    def _decode(self, decode, query, slot_mapping) -> None:
        """Store each decode row's new token and let the state observe its query's attention."""
        rows_n = self.kv.slots.lengths.shape[0]
        rows = torch.tensor([d[0] for d in decode])
        tokens = torch.tensor([d[1] for d in decode])
        valid = torch.zeros(rows_n, 1, dtype=torch.bool)
        valid[rows] = True
        ids = torch.zeros(rows_n, self.kv_heads, 1, 1, dtype=torch.long)
        ids[rows] = slot_mapping[tokens].long()[:, None, None, None]  # (D, 1, 1, 1): same slot, every KV head
        self.kv.append(ids, ids, valid, valid.long().cumsum(1))
        length = int(self.kv.slots.lengths[rows].max())
        keys_t, _, block = self.store.cache  # type: ignore[misc]
        k = gather_keys(keys_t, self.store.where[rows, :, :length], block)  # (D, H_kv, L, Dh)
        q = query[tokens].float().view(len(decode), self.kv_heads, self.group, -1)  # (D, H_kv, g, Dh)
        logits = torch.einsum("rhgd,rhld->rhgl", q, k.float()) * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        stored = self.kv.slots.lengths[rows]
        beyond = torch.arange(length)[None, :] >= stored[:, None]  # (D, L)
        probs = logits.masked_fill(beyond[:, None, None, :], float("-inf")).softmax(-1)
        pooled = torch.zeros(rows_n, self.kv_heads, self.group, 1, length)
        pooled[rows] = probs[:, :, :, None, :]
        attended = torch.ones(rows_n, 1, 1, 1, 1)
        attended[rows, 0, 0, 0, 0] = stored.float()
        steps = (self.kv.slots.seen - 1).clamp(min=0)[:, None]  # (R, 1) each query's step
        for state in self.kv.states:
            if state.wants_attention:
                state.observe(pooled, attended, steps, valid)

    def _prepare_next(self, full, block_table, block: int) -> None:
        """Each full row drops one token; the token in the slot that leaves the window next takes its slot."""
        rows_n = self.kv.slots.lengths.shape[0]
        batch = torch.tensor([f[0] for f in full])
        rows = torch.tensor([f[1] for f in full])
        which = torch.zeros(rows_n, dtype=torch.bool)
        which[rows] = True
        last = self.kv.slots.seen[rows] - 1  # (F,) newest position
        leaving = self._phys_rows(block_table[batch], last - self.budget + 1, block)  # (F,)
        self.kv.compress(which)
        kept = self.budget - 1
        where = self.store.where[rows]  # (F, H_kv, B): kept first, the dropped token's slot last
        freed = where[:, :, kept]  # (F, H_kv)
        match = where[:, :, :kept] == leaving[:, None, None]  # (F, H_kv, B - 1)
        moved = match.any(dim=-1)  # (F, H_kv)
        if not bool(moved.any()):
            return
        f_idx, h_idx = moved.nonzero(as_tuple=True)
        slot = match[f_idx, h_idx].float().argmax(dim=-1)
        keys_t, values, _ = self.store.cache  # type: ignore[misc]
        copy_slots(keys_t, values, leaving[f_idx], freed[f_idx, h_idx], h_idx, block)
        self.store.where[rows[f_idx], h_idx, slot] = freed[f_idx, h_idx]

    @staticmethod
    def _phys(table_row: torch.Tensor, positions: torch.Tensor, block: int) -> torch.Tensor:
        """Physical slots of logical ``positions`` (any shape) through one request's block table."""
        return table_row.long()[positions // block] * block + positions % block

    @staticmethod
    def _phys_rows(tables: torch.Tensor, positions: torch.Tensor, block: int) -> torch.Tensor:
        """One logical position per request (F,) through its block-table row (F, blocks)."""
        blocks = tables.long().gather(1, (positions // block)[:, None])[:, 0]
        return blocks * block + positions % block
