"""ScissorhandsCache: a transformers ``Cache`` whose full-attention layers hold a fixed token budget.

Each :class:`ScissorhandsLayer` keeps, per sequence and per KV head, at most
``budget`` tokens in preallocated buffers. ``update`` only hands the new
chunk to the registered attention function (see :mod:`scissorhands.attention`),
which calls :meth:`ScissorhandsLayer.attend`. ``attend`` streams the chunk
through the cache in blocks: compress when full, append a block, attend over
the stored tokens plus the block (causally), accumulate importance. The block
between two compressions is computed at once, so a chunk gives exactly what
feeding its tokens one at a time would give, at the cost of one matmul per block.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin, get_layer_types_and_kwargs

from .config import ScissorhandsConfig
from .importance import ImportanceState
from .kvstore import DenseKVStore
from .policy import EvictionPolicy, ImportancePolicy
from .schedule import layer_budgets

NATIVE_WINDOW_TYPES = ("sliding_attention", "chunked_attention")


class ScissorhandsLayer(CacheLayerMixin):
    """One layer's budgeted K/V store.

    ``keys``/``values`` are buffers of shape (B, H_kv, capacity, D) with
    ``capacity <= budget``. Row ``b`` holds ``lengths[b]`` tokens in its first
    slots, in the order they were appended; padding is never stored, so rows of
    a left-padded batch hold exactly what they would hold alone. ``positions``
    (B, H_kv, capacity) is each slot's index among its sequence's real tokens
    (its rotary position), -1 for an empty slot.

    Parameters
    ----------
    budget : int
        Most tokens this layer may store per sequence at any instant.
    recent : int
        Number of most recently appended tokens that are never evicted.
    drop : int
        Least number of tokens evicted at one compression.
    importance : ImportanceState
        Bucketed attention history, compacted with the same index as K/V.
    policy : EvictionPolicy
        Scores stored tokens; the layer does the selection.
    query_tile : int
        Most query rows scored at once.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        budget: int,
        recent: int,
        drop: int,
        importance: ImportanceState,
        policy: EvictionPolicy,
        query_tile: int = 256,
    ):
        self.store = DenseKVStore()  # before the base __init__, which assigns keys/values
        super().__init__()
        if drop > budget - recent:
            raise ValueError(f"drop: must be <= budget - recent ({budget - recent}) for this layer, got {drop}")
        self.budget = budget
        self.recent = recent
        self.drop = drop
        self.importance = importance
        self.policy = policy
        self.query_tile = query_tile
        self.layer_idx = 0  # set by the cache; lets policies tell layers apart
        self.reset()

    # transformers' base class and callers read `keys`/`values`; they are the store's buffers.
    @property
    def keys(self) -> torch.Tensor | None:
        return self.store.keys

    @keys.setter
    def keys(self, value) -> None:
        self.store.keys = value

    @property
    def values(self) -> torch.Tensor | None:
        return self.store.values

    @values.setter
    def values(self, value) -> None:
        self.store.values = value

    # -- transformers layer API ---------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape  # (B, H_kv, T, D)
        self.device = key_states.device
        self.store.allocate(key_states, value_states)
        self.positions = torch.empty(b, h, 0, dtype=torch.int32, device=self.device)
        self.lengths = torch.zeros(b, dtype=torch.long)  # CPU: stored tokens per row
        self.row_seen = torch.zeros(b, dtype=torch.long)  # CPU: real tokens seen per row
        self._uniform = (0, 0)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs=None, **extra):
        """Register the new chunk for the attention call that follows; store nothing yet."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if kwargs is None:
            raise ValueError(
                "model: unsupported architecture: its attention does not pass its kwargs to the cache, "
                "so the scissorhands attention cannot be routed"
            )
        if self._pending is not None:
            raise RuntimeError(
                "attention was not routed through scissorhands: call scissorhands.enable(model) "
                "or build the cache with ScissorhandsCache(model, config)"
            )
        self._pending = key_states.shape[-2]
        self.seen += key_states.shape[-2]
        kwargs["scissorhands_layer"] = self
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The model's mask covers the new chunk only (causal + padding); stored
        # tokens are masked by the layer itself, since slots are not positions.
        return query_length, self.seen

    def get_seq_length(self) -> int:
        """Tokens seen so far (padding included): the next chunk's offset, not the stored length."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.positions = None
        self.lengths = self.row_seen = None
        # (stored, seen) shared by every row, or None: lets decoding skip per-row bookkeeping.
        self._uniform: tuple[int, int] | None = None
        self.importance.acc = None
        self.seen = 0
        self.peak = 0  # most tokens any row ever stored: the budget bounds this
        self.compressions = 0
        self._pending: int | None = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ScissorhandsCache cannot roll back: evicted tokens are gone")

    def _select_batch(self, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        dev = index.to(self.device)
        self.store.select_batch(dev)
        self.positions = self.positions.index_select(0, dev)
        cpu = index.cpu()
        self.lengths = self.lengths.index_select(0, cpu)
        self.row_seen = self.row_seen.index_select(0, cpu)
        if self.importance.acc is not None:
            self.importance.select_batch(dev)
        self._sync_uniform()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            b = self.keys.shape[0]
            self._select_batch(torch.arange(b).repeat_interleave(repeats))

    # -- storage ---------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.store.capacity

    @property
    def length(self) -> int:
        """Longest row's stored length (the slots any row uses)."""
        return 0 if self.lengths is None or self.lengths.numel() == 0 else int(self.lengths.max())

    def _aligned(self, lengths: torch.Tensor) -> bool:
        """Do all rows store as many tokens and sit at the same step? Then scalar fast paths apply."""
        return bool((lengths == lengths[0]).all()) and bool((self.row_seen == self.row_seen[0]).all())

    def _sync_uniform(self) -> None:
        aligned = self.lengths.numel() > 0 and self._aligned(self.lengths)
        self._uniform = (int(self.lengths[0]), int(self.row_seen[0])) if aligned else None

    def _reserve(self, needed: int) -> None:
        """Grow the buffers (geometrically, never past the budget) to hold ``needed`` slots."""
        cap = self.capacity
        if needed <= cap:
            return
        new_cap = min(self.budget, max(needed, 2 * cap, 16))
        self.store.grow(new_cap)
        positions = self.positions.new_full((*self.positions.shape[:2], new_cap), -1)  # (B, H_kv, new_cap)
        positions[:, :, :cap] = self.positions
        self.positions = positions
        self.importance.grow(new_cap)

    def _append(self, key, value, valid, cum) -> None:
        """Write each row's real tokens of a block after its stored ones.

        key, value : (B, H_kv, c, D); valid : (B, c) bool or None (all real);
        cum : (B, c) CPU, real tokens of the block up to and including each index.
        """
        c = key.shape[-2]
        added = cum[:, -1]  # (B,)
        self._reserve(int((self.lengths + added).max()))
        if valid is None and self._aligned(self.lengths):
            start = int(self.lengths[0])
            self.store.write(start, key, value)
            pos = int(self.row_seen[0]) + torch.arange(c, dtype=torch.int32, device=self.device)
            self.positions[:, :, start : start + c] = pos
            self.importance.clear(start, start + c)
        else:
            rows, cols = (valid if valid is not None else torch.ones_like(cum, dtype=torch.bool)).nonzero(as_tuple=True)
            slots = self.lengths[rows] + cum[rows, cols] - 1  # (N,)
            pos = (self.row_seen[rows] + cum[rows, cols] - 1).to(torch.int32)
            r, sl, cl = rows.to(self.device), slots.to(self.device), cols.to(self.device)
            self.store.write_at(r, sl, key[r, :, cl], value[r, :, cl])  # (N, H_kv, D) each
            self.positions[r, :, sl] = pos.to(self.device)[:, None]
            self.importance.clear_slots(r, sl)
        self.lengths += added
        self.row_seen += added
        self.peak = max(self.peak, self.length)
        self._sync_uniform()

    def _compress(self, rows: torch.Tensor) -> None:
        """Evict ``drop`` tokens from each KV head of the full rows ``rows`` (CPU bool, (B,))."""
        length = self.length
        lengths = self.lengths.to(self.device)
        n_drop = torch.where(rows, self.drop, 0).to(self.device)  # (B,)
        score = self.policy.scores(self, length).clone()  # (B, H_kv, L) float32
        slot = torch.arange(length, device=self.device)
        # Never drop the recent window or empty slots: give them +inf.
        shielded = slot[None, :] >= (lengths - self.recent)[:, None]  # (B, L)
        score.masked_fill_(shielded[:, None, :], float("inf"))
        # Stable ascending sort: among equal scores the older slot comes first and goes first.
        order = torch.sort(score, dim=-1, stable=True).indices  # (B, H_kv, L)
        ranked_drop = slot[None, None, :] < n_drop[:, None, None]  # (B, 1, L): rank < n_drop
        dropped = torch.zeros_like(score, dtype=torch.bool).scatter_(2, order, ranked_drop.expand_as(order))
        # Kept slots first, in stored order; dropped ones after (then overwritten).
        keep = torch.sort(dropped.to(torch.uint8), dim=-1, stable=True).indices  # (B, H_kv, L)
        self.store.reorder(keep)
        self.positions[:, :, :length] = self.positions[:, :, :length].gather(2, keep)
        self.importance.compact(keep)
        self.lengths -= torch.where(rows, self.drop, 0)
        empty = slot[None, :] >= self.lengths.to(self.device)[:, None]  # (B, L)
        self.positions[:, :, :length].masked_fill_(empty[:, None, :], -1)
        self.compressions += 1
        self._sync_uniform()

    # -- attention -------------------------------------------------------------------------
    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        scaling: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Stream a chunk through the budgeted cache and return its attention output.

        The chunk is cut into blocks at the points where some row must compress
        (its next real token would exceed the budget); each block is one
        attention computation. The result equals feeding the tokens one by one.

        Parameters
        ----------
        query : Tensor, shape (B, H_q, T, D)
        key, value : Tensor, shape (B, H_kv, T, D)
            The chunk handed to :meth:`update`.
        mask : Tensor of bool, shape (B, 1, T, T), or None
            The model's causal + padding mask over the chunk (True = attend).
        scaling : float
            Logit scale.
        softcap : float, optional
            Logit soft-capping (``tanh(x / c) * c``), for models that use it.

        Returns
        -------
        Tensor, shape (B, H_q, T, D_v); padding queries get zeros.
        """
        total = key.shape[-2]
        if self._pending != total:
            raise RuntimeError("scissorhands attention called without a matching cache update")
        self._pending = None
        b, h_q, _, d = query.shape  # (B, H_q, T, D)
        h = key.shape[1]
        if h_q % h:
            raise ValueError(f"model: {h_q} query heads cannot share {h} KV heads")
        g = h_q // h
        if self.importance.acc is None:
            # Allocated here: the count dtype depends on the group size, sum on the compute dtype.
            self.importance.allocate(b, h, self.capacity, group=g, device=self.device, dtype=query.dtype)

        if total == 1 and mask is None and self._uniform is not None:
            return self._decode_step(query, key, value, scaling, softcap)

        valid = None
        if mask is not None:
            last = mask[:, 0, -1, :]  # (B, T): what the chunk's last query may see
            last = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
            if not bool(last.all()):
                valid = last.cpu()
        cum = (torch.ones(b, total, dtype=torch.long) if valid is None else valid.long()).cumsum(dim=1)  # (B, T)

        q = query.reshape(b, h, g, total, d)  # (B, H_kv, g, T, D)
        out = query.new_empty(b, h, g, total, value.shape[-1])  # (B, H_kv, g, T, D_v)
        i = 0
        while i < total:
            before = cum[:, i - 1] if i > 0 else torch.zeros(b, dtype=torch.long)
            coming = cum[:, -1] - before  # real tokens left per row
            full = (self.lengths >= self.budget) & (coming > 0)
            if bool(full.any()):
                self._compress(full)
            free = self.budget - self.lengths  # (B,)
            # Block end: the first index at which some row would exceed its free space.
            over = (cum - before[:, None]) > free[:, None]  # (B, T)
            over[:, :i] = False
            stops = torch.where(over.any(dim=1), over.float().argmax(dim=1), total)
            e = int(stops.min())
            bcum = cum[:, i:e] - before[:, None]  # (B, c)
            bvalid = None if valid is None else valid[:, i:e]
            base = self.lengths.clone()
            self._append(key[:, :, i:e], value[:, :, i:e], bvalid, bcum)
            self._attend_block(q[:, :, :, i:e], out[:, :, :, i:e], base, bcum, bvalid, scaling, softcap)
            i = e
        return out.view(b, h_q, total, -1)

    def _decode_step(self, query, key, value, scaling, softcap) -> torch.Tensor:
        """One new token per row, all rows in step: the per-token path, kept to a few tensor ops."""
        b, h_q, _, d = query.shape  # (B, H_q, 1, D)
        h = key.shape[1]
        length, seen = self._uniform
        if length >= self.budget:
            self._compress(torch.ones(b, dtype=torch.bool))
            length, seen = self._uniform
        self._reserve(length + 1)
        self.store.write(length, key, value)
        self.positions[:, :, length] = seen
        self.importance.clear(length, length + 1)
        length += 1
        self.lengths += 1
        self.row_seen += 1
        self._uniform = (length, seen + 1)
        self.peak = max(self.peak, length)
        q = query.view(b, h, h_q // h, d)  # (B, H_kv, g, D)
        keys, values = self.store.read(length)  # (B, H_kv, L, D) each
        logits = torch.matmul(q, keys.transpose(-1, -2))  # (B, H_kv, g, L)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * scaling
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        probs = torch.softmax(logits, dim=-1)  # (B, H_kv, g, L)
        ctx = torch.matmul(probs.to(values.dtype), values)  # (B, H_kv, g, D_v)
        if self.policy.tracks_attention:
            if self.importance.form == "sum":
                contrib = probs.sum(dim=2)  # (B, H_kv, L)
            else:
                contrib = (probs > 1.0 / length).sum(dim=2, dtype=torch.float32)
            self.importance.add_step(seen, contrib)
        return ctx.view(b, h_q, 1, -1)

    def _attend_block(self, q, out, base, cum, valid, scaling, softcap) -> None:
        """Queries of one block over each row's old slots plus the block's real tokens (causal).

        q : (B, H_kv, g, c, D); out : (B, H_kv, g, c, D_v), written in place;
        base : (B,) CPU stored lengths before the block; cum, valid : (B, c) CPU.
        """
        b, h, g, c, d = q.shape
        track = self.policy.tracks_attention
        aligned = valid is None and self._aligned(base)
        a = 0
        while a < c:
            e = min(c, a + self.query_tile)
            n = e - a
            limit = base[:, None] + cum[:, a:e]  # (B, n) slots each query sees
            length = int(limit.max())
            keys, values = self.store.read(length)  # (B, H_kv, L, D) each
            qt = q[:, :, :, a:e].reshape(b, h, g * n, d)  # (B, H_kv, g*n, D)
            logits = torch.matmul(qt, keys.transpose(-1, -2)).view(b, h, g, n, length)  # (B, H_kv, g, n, L)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * scaling
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            need_mask = not (aligned and n == 1)
            if need_mask:
                slot = torch.arange(length, device=self.device)
                allowed = slot < limit.to(self.device)[:, :, None]  # (B, n, L)
                logits = logits.masked_fill(~allowed[:, None, None], torch.finfo(logits.dtype).min)
            probs = torch.softmax(logits, dim=-1)  # (B, H_kv, g, n, L)
            if valid is not None:
                probs = probs * valid[:, a:e].to(device=self.device, dtype=probs.dtype)[:, None, None, :, None]
            ctx = torch.matmul(probs.to(values.dtype).view(b, h, g * n, length), values)
            out[:, :, :, a:e] = ctx.view(b, h, g, n, -1)
            if track:
                attended = limit.to(device=self.device, dtype=probs.dtype)[:, None, None, :, None]  # (B, 1, 1, n, 1)
                contrib = self.importance.contributions(probs, attended)  # (B, H_kv, n, L)
                steps = self.row_seen[:, None] - (cum[:, -1:] - cum[:, a:e]) - 1  # (B, n) CPU
                if aligned and n == 1:
                    self.importance.add_step(int(steps[0, 0]), contrib[:, :, 0])
                else:
                    qvalid = torch.ones(b, n, dtype=torch.bool) if valid is None else valid[:, a:e]
                    self.importance.add(steps, qvalid, contrib)
            a = e

    # -- reporting -------------------------------------------------------------------------
    def stored_positions(self, row: int) -> torch.Tensor:
        """Positions stored for sequence ``row``, shape (H_kv, lengths[row]), in stored order."""
        return self.positions[row, :, : int(self.lengths[row])]

    def memory(self) -> dict:
        """Bytes and tokens held by this layer."""
        if not self.is_initialized:
            return {"budget": self.budget, "stored": 0, "peak": 0, "capacity": 0, "seen": 0, "kv_bytes": 0,
                    "importance_bytes": 0, "position_bytes": 0, "full_kv_bytes": 0}
        b, h, cap, _ = self.keys.shape
        per_token_head = self.store.bytes_per_token_head()
        return {
            "budget": self.budget,
            "stored": self.length,
            "peak": self.peak,
            "capacity": cap,
            "seen": int(self.row_seen.max()),
            "kv_bytes": self.store.nbytes(),
            "importance_bytes": self.importance.nbytes(),
            "position_bytes": self.positions.nbytes,
            "full_kv_bytes": int(self.row_seen.sum()) * h * per_token_head,
            "kv_bytes_per_token_head": per_token_head,
            "importance_bytes_per_token_head": self.importance.bytes_per_token_head(),
        }


class ScissorhandsCache(Cache):
    """A drop-in ``past_key_values`` for ``model.generate`` that evicts by persistence of importance.

    Full-attention layers become :class:`ScissorhandsLayer` with a per-layer budget
    from the schedule; sliding-window layers keep transformers' own
    ``DynamicSlidingWindowLayer`` and their native window.

    Parameters
    ----------
    model : PreTrainedModel or PretrainedConfig
        The model (its attention is switched to the scissorhands function, see
        :func:`scissorhands.attention.enable`) or just its config, if the
        caller enables the attention itself.
    config : ScissorhandsConfig
        Budget, windows, drop amount, importance form and schedule.
    policy : EvictionPolicy, optional
        Scoring rule; defaults to Scissorhands importance.

    Examples
    --------
    >>> cache = ScissorhandsCache(model, ScissorhandsConfig(budget=400))
    >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=100)
    >>> cache.memory_report()["max_stored"] <= 400
    True
    """

    def __init__(self, model, config: ScissorhandsConfig, policy: EvictionPolicy | None = None):
        from .attention import enable

        model_config = getattr(model, "config", model)
        if hasattr(model, "set_attn_implementation"):
            enable(model)
        text_config = model_config.get_text_config(decoder=True)
        if getattr(model_config, "is_encoder_decoder", False):
            raise ValueError(f"model: unsupported architecture {model_config.model_type!r} (encoder-decoder)")
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        unknown = sorted({t for t in layer_types if t != "full_attention" and t not in NATIVE_WINDOW_TYPES})
        if unknown:
            raise ValueError(f"model: unsupported architecture {model_config.model_type!r} (layer types {unknown})")
        if not full:
            raise ValueError(
                f"model: {model_config.model_type!r} has no full-attention layer (all keep a native window); "
                "there is nothing to budget"
            )
        self.config = config
        self.policy = policy or ImportancePolicy()
        budgets = iter(layer_budgets(config, len(full)))
        layers = []
        for idx, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs)):
            if layer_type == "full_attention":
                budget = next(budgets)
                if budget <= config.recent:
                    raise ValueError(f"schedule: a layer budget ({budget}) must be > recent ({config.recent})")
                layers.append(
                    ScissorhandsLayer(
                        budget=budget,
                        recent=config.recent,
                        drop=config.drop_for(budget),
                        importance=ImportanceState(config.importance, config.bucket_steps(), config.n_buckets()),
                        policy=self.policy,
                        query_tile=config.query_tile,
                    )
                )
                layers[-1].layer_idx = idx
            else:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[layer_type](**kwargs))
        super().__init__(layers=layers)

    @property
    def budgeted_layers(self) -> list[ScissorhandsLayer]:
        return [layer for layer in self.layers if isinstance(layer, ScissorhandsLayer)]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Sliding layers count the same tokens; read a budgeted layer for a uniform answer.
        layers = self.budgeted_layers
        return layers[0].seen if layers else super().get_seq_length(layer_idx)

    def memory_report(self) -> dict:
        """K/V, importance-state and position bytes, and tokens stored, per layer and in total.

        Returns
        -------
        dict
            ``layers``: one dict per layer (budgeted layers have ``budget``);
            totals ``kv_bytes`` (allocated), ``budgeted_kv_bytes``,
            ``importance_bytes``, ``position_bytes``, ``full_kv_bytes`` (what a
            full cache would hold for the budgeted layers), ``max_stored`` (now),
            ``peak_stored`` (ever, in any layer) and ``stored_per_layer``.
        """
        per_layer = []
        for layer in self.layers:
            if isinstance(layer, ScissorhandsLayer):
                per_layer.append(layer.memory())
            else:
                kv = 0 if layer.keys is None else layer.keys.nbytes + layer.values.nbytes
                stored = 0 if layer.keys is None or layer.keys.numel() == 0 else layer.keys.shape[-2]
                per_layer.append({"sliding_window": getattr(layer, "sliding_window", None), "stored": stored,
                                  "kv_bytes": kv})
        budgeted = [m for m in per_layer if "budget" in m]
        total = {key: sum(m.get(key, 0) for m in per_layer) for key in ("kv_bytes", "importance_bytes",
                                                                         "position_bytes")}
        total["full_kv_bytes"] = sum(m["full_kv_bytes"] for m in budgeted)
        total["budgeted_kv_bytes"] = sum(m["kv_bytes"] for m in budgeted)
        total["max_stored"] = max(m["stored"] for m in budgeted)
        total["peak_stored"] = max(m["peak"] for m in budgeted)
        total["stored_per_layer"] = [m["stored"] for m in per_layer]
        total["layers"] = per_layer
        return total
