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
from .policy import EvictionPolicy, ImportancePolicy
from .schedule import layer_budgets

NATIVE_WINDOW_TYPES = ("sliding_attention", "chunked_attention")


class ScissorhandsLayer(CacheLayerMixin):
    """One layer's budgeted K/V store.

    ``keys``/``values`` are buffers of shape (B, H_kv, capacity, D) with
    ``capacity <= budget``; the first ``length`` slots hold the stored tokens in
    the order they were appended. ``positions`` (B, H_kv, capacity) holds each
    slot's index in the input stream, -1 for padding.

    Parameters
    ----------
    budget : int
        Most tokens this layer may store at any instant.
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
        super().__init__()
        if drop > budget - recent:
            raise ValueError(f"drop: must be <= budget - recent ({budget - recent}) for this layer, got {drop}")
        self.budget = budget
        self.recent = recent
        self.drop = drop
        self.importance = importance
        self.policy = policy
        self.query_tile = query_tile
        self.positions: torch.Tensor | None = None
        self.length = 0  # stored slots
        self.seen = 0  # tokens appended so far, evicted and padding included
        self.compressions = 0
        self.has_padding = False
        self._pending: tuple[int, int] | None = None  # (first step, chunk length) awaiting attend()

    # -- transformers layer API ---------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape  # (B, H_kv, T, D)
        self.device = key_states.device
        self.keys = key_states.new_empty(b, h, 0, d)
        self.values = value_states.new_empty(b, h, 0, value_states.shape[-1])
        self.positions = torch.empty(b, h, 0, dtype=torch.int32, device=self.device)
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
        chunk = key_states.shape[-2]
        self._pending = (self.seen, chunk)
        self.seen += chunk
        kwargs["scissorhands_layer"] = self
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The model's mask covers the new chunk only (causal + padding); the stored
        # tokens' mask comes from `positions`, since their slots are not positions.
        return query_length, self.seen

    def get_seq_length(self) -> int:
        """Tokens seen so far: the position of the next token, not the stored length."""
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.positions = None
        self.importance.acc = None
        self.length = self.seen = self.compressions = 0
        self.has_padding = False
        self._pending = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("ScissorhandsCache cannot roll back: evicted tokens are gone")

    def _select_batch(self, index: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        index = index.to(self.keys.device)
        self.keys = self.keys.index_select(0, index)
        self.values = self.values.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.importance.select_batch(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            b = self.keys.shape[0]
            self._select_batch(torch.arange(b, device=self.keys.device).repeat_interleave(repeats))

    # -- storage ---------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def _reserve(self, needed: int) -> None:
        """Grow the buffers (geometrically, never past the budget) to hold ``needed`` slots."""
        cap = self.capacity
        if needed <= cap:
            return
        new_cap = min(self.budget, max(needed, 2 * cap, 16))
        b, h, _, d = self.keys.shape  # (B, H_kv, cap, D)

        def grown(t: torch.Tensor, fill=0) -> torch.Tensor:
            out = t.new_full((*t.shape[:2], new_cap, *t.shape[3:]), fill)
            out[:, :, : self.length] = t[:, :, : self.length]
            return out

        self.keys = grown(self.keys)
        self.values = grown(self.values)
        self.positions = grown(self.positions, -1)
        self.importance.grow(new_cap)

    def _append(self, key: torch.Tensor, value: torch.Tensor, first: int, valid: torch.Tensor | None) -> None:
        """Write a block of ``c`` tokens after the stored ones; ``valid`` (B, c) marks non-padding."""
        c = key.shape[-2]
        start, end = self.length, self.length + c
        self._reserve(end)
        self.keys[:, :, start:end] = key
        self.values[:, :, start:end] = value
        pos = torch.arange(first, first + c, dtype=torch.int32, device=self.device)  # (c,)
        if valid is None:
            self.positions[:, :, start:end] = pos
        else:
            pos = torch.where(valid, pos, -1)  # (B, c)
            self.positions[:, :, start:end] = pos[:, None, :]
        self.importance.clear(start, end)
        self.length = end

    def _compress(self, need: int) -> None:
        """Evict ``max(drop, need)`` tokens per sequence and KV head."""
        length = self.length
        n_drop = max(self.drop, need)
        score = self.policy.scores(self, length).clone()  # (B, H_kv, L) float32
        pos = self.positions[:, :, :length]  # (B, H_kv, L)
        score.masked_fill_(pos < 0, float("-inf"))
        r = min(self.recent, length)
        if r > 0:
            tail = score[..., length - r :]
            tail.masked_fill_(pos[..., length - r :] >= 0, float("inf"))
        # Stable ascending sort: among equal scores the older slot comes first and goes first.
        order = torch.sort(score, dim=-1, stable=True).indices  # (B, H_kv, L)
        keep = order[..., n_drop:].sort(dim=-1).values  # (B, H_kv, L - n_drop), in stored order
        k = keep.shape[-1]
        d_k, d_v = self.keys.shape[-1], self.values.shape[-1]
        self.keys[:, :, :k] = self.keys.gather(2, keep.unsqueeze(-1).expand(-1, -1, -1, d_k))
        self.values[:, :, :k] = self.values.gather(2, keep.unsqueeze(-1).expand(-1, -1, -1, d_v))
        self.positions[:, :, :k] = self.positions.gather(2, keep)
        self.positions[:, :, k:] = -1
        self.importance.compact(keep)
        self.length = k
        self.compressions += 1

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
        Tensor, shape (B, H_q, T, D_v)
        """
        if self._pending is None or self._pending[1] != key.shape[-2]:
            raise RuntimeError("scissorhands attention called without a matching cache update")
        first, total = self._pending
        self._pending = None
        b, h_q, _, d = query.shape  # (B, H_q, T, D)
        h = key.shape[1]
        if h_q % h:
            raise ValueError(f"model: {h_q} query heads cannot share {h} KV heads")
        g = h_q // h
        if self.importance.acc is None:
            # Allocated here, not in lazy_initialization: the count dtype depends on the group size.
            self.importance.allocate(b, h, self.capacity, group=g, device=self.device)

        valid = None
        if mask is not None:
            last = mask[:, 0, -1, :]  # (B, T): what the chunk's last query may see
            valid = last if last.dtype == torch.bool else last > torch.finfo(last.dtype).min / 2
            if bool(valid.all()):
                valid = None
            else:
                self.has_padding = True

        q = query.reshape(b, h, g, total, d)  # (B, H_kv, g, T, D)
        out = query.new_empty(b, h, g, total, value.shape[-1])  # (B, H_kv, g, T, D_v)
        i = 0
        while i < total:
            if self.length >= self.budget:
                self._compress(self.length + 1 - self.budget)
            c = min(total - i, self.budget - self.length)
            block_valid = None if valid is None else valid[:, i : i + c]
            stored = self.length
            self._append(key[:, :, i : i + c], value[:, :, i : i + c], first + i, block_valid)
            self._attend_block(q[:, :, :, i : i + c], out[:, :, :, i : i + c], first + i, stored, block_valid,
                               scaling, softcap)
            i += c
        return out.view(b, h_q, total, -1)

    def _attend_block(self, q, out, first_step, stored, valid, scaling, softcap) -> None:
        """Queries of one block over the ``stored`` old slots plus the block itself (causal).

        q : (B, H_kv, g, c, D); out : (B, H_kv, g, c, D_v) written in place;
        valid : (B, c) or None.
        """
        b, h, g, c, d = q.shape
        imp = self.importance
        track = self.policy.tracks_attention
        a = 0
        while a < c:
            e = min(c, a + self.query_tile)
            boundary = imp.next_boundary(first_step + a)
            if track and boundary is not None:
                e = min(e, boundary - first_step)
            n, length = e - a, stored + e
            keys = self.keys[:, :, :length]  # (B, H_kv, L, D)
            qt = q[:, :, :, a:e].reshape(b, h, g * n, d)  # (B, H_kv, g*n, D)
            logits = torch.matmul(qt, keys.transpose(-1, -2)).view(b, h, g, n, length)  # (B, H_kv, g, n, L)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * scaling
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            allowed = None
            if n > 1:
                slot = torch.arange(length, device=q.device)
                row_end = stored + a + 1 + torch.arange(n, device=q.device)
                allowed = (slot[None, :] < row_end[:, None])[None, None, None]  # (1, 1, 1, n, L)
            if self.has_padding:
                key_ok = (self.positions[:, :, :length] >= 0)[:, :, None, None, :]  # (B, H_kv, 1, 1, L)
                allowed = key_ok if allowed is None else allowed & key_ok
            if allowed is not None:
                logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min)
            probs = torch.softmax(logits, dim=-1)  # (B, H_kv, g, n, L)
            if valid is not None:
                probs = probs * valid[:, None, None, a:e, None]  # padding queries attend nowhere
            ctx = torch.matmul(probs.to(self.values.dtype).view(b, h, g * n, length), self.values[:, :, :length])
            out[:, :, :, a:e] = ctx.view(b, h, g, n, -1)
            if track:
                if allowed is None:
                    attended = torch.full((1, 1, 1, n, 1), length, device=q.device)
                else:
                    attended = allowed.sum(dim=-1, keepdim=True)  # (B|1, H_kv|1, 1, n, 1)
                imp.add(first_step + a, probs, attended)
            a = e

    # -- reporting -------------------------------------------------------------------------
    def stored_positions(self) -> torch.Tensor:
        """Input-stream index of each stored slot, shape (B, H_kv, length); -1 is padding."""
        return self.positions[:, :, : self.length]

    def memory(self) -> dict:
        """Bytes and tokens held by this layer."""
        if not self.is_initialized:
            return {"budget": self.budget, "stored": 0, "capacity": 0, "seen": 0,
                    "kv_bytes": 0, "importance_bytes": 0, "position_bytes": 0, "full_kv_bytes": 0}
        b, h, cap, d = self.keys.shape
        per_token = b * h * (d * self.keys.element_size() + self.values.shape[-1] * self.values.element_size())
        return {
            "budget": self.budget,
            "stored": self.length,
            "capacity": cap,
            "seen": self.seen,
            "kv_bytes": self.keys.nbytes + self.values.nbytes,
            "importance_bytes": self.importance.nbytes(),
            "position_bytes": self.positions.nbytes,
            "full_kv_bytes": per_token * self.seen,
            "kv_bytes_per_token_head": per_token // (b * h),
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
        for layer_type, kwargs in zip(layer_types, layer_kwargs):
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
            totals ``kv_bytes``, ``importance_bytes``, ``position_bytes``,
            ``full_kv_bytes`` (what a full cache would hold for the budgeted
            layers), ``max_stored`` and ``stored_per_layer``.
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
        total["stored_per_layer"] = [m["stored"] for m in per_layer]
        total["layers"] = per_layer
        return total
