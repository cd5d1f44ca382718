"""Guards that keep a cache with the model and the sequence it was built for.

A :class:`~scissorhands.hf.cache.ScissorhandsCache` records the model it was built
for; used with another model (other layer types, KV heads, head size or
sliding windows) it raises a one-line ``ValueError`` naming ``model`` rather
than computing something wrong. A used cache takes only input that continues
what it has seen; an independent prompt is a one-line error naming ``cache``.
"""

from __future__ import annotations

import torch

from scissorhands.core.tokens.slots import SlotTable

from .modelinfo import ModelFacts, model_facts


def model_signature(facts: ModelFacts) -> dict:
    """What a cache must match in the model it is used with: layer types (so their count), K/V heads,
    head size and sliding windows."""
    return {**facts.signature, "sliding_windows": facts.sliding_windows}


def _describe(sig: dict) -> str:
    types = sig["layer_types"]
    counts = ", ".join(f"{types.count(t)} {t}" for t in dict.fromkeys(types))
    return f"{len(types)} layers ({counts}), {sig['num_kv_heads']} KV heads of size {sig['head_dim']}"


def _mismatch(expected: dict, got: dict, what: str = "") -> ValueError:
    return ValueError(f"model: this ScissorhandsCache was built for a model with {_describe(expected)}, but is used "
                      f"with {what or 'one with ' + _describe(got)}; build one cache per model")


class ModelGuard:
    """The model a cache was built for, checked against what it meets; shared by the cache's layers."""

    def __init__(self, facts: ModelFacts):
        self.expected = model_signature(facts)
        self._signatures: dict[int, tuple[object, dict]] = {}  # config id -> (config, signature)
        self._checked: object = None  # the config last found to match

    def check_module(self, module, layer_idx: int) -> None:
        """Raise if ``module`` (an attention module, with its ``config`` and ``layer_idx``) is of another model.

        Checked once per model config; the attention function calls it before attending.
        """
        config = getattr(module, "config", None)
        if config is None or config is self._checked:
            return
        entry = self._signatures.get(id(config))
        if entry is None or entry[0] is not config:
            entry = (config, model_signature(model_facts(config)))
            self._signatures[id(config)] = entry
        if entry[1] != self.expected:
            raise _mismatch(self.expected, entry[1])
        module_layer = getattr(module, "layer_idx", None)
        if isinstance(module_layer, int) and module_layer != layer_idx:
            raise ValueError(f"model: attention layer {module_layer} reached the cache's layer {layer_idx}; "
                             "the cache does not belong to this model")
        self._checked = config

    def check_keys(self, key_states: torch.Tensor, layer_idx: int) -> None:
        """Raise if a layer's first keys do not have the K/V heads and head size the cache was built for."""
        if key_states.shape[1] != self.expected["num_kv_heads"] or key_states.shape[-1] != self.expected["head_dim"]:
            raise _mismatch(self.expected, {}, f"keys of {key_states.shape[1]} KV heads of size "
                            f"{key_states.shape[-1]} in layer {layer_idx}")


def reuse_message(seen: int) -> str:
    return (f"cache: this ScissorhandsCache has already seen {seen} tokens; it is continued only by input that "
            "goes on from them (the whole conversation so far, then new tokens); for an independent prompt "
            "call cache.reset() or build a new cache")


def check_holds(slots: SlotTable, dtype: torch.dtype, key_states: torch.Tensor) -> None:
    """A used cache takes the batch and the dtype it holds: another is a one-line ``ValueError`` naming ``cache``.

    A batch that grows for beams or shrinks between steps goes through the cache's own reordering
    (``batch_repeat_interleave``, ``reorder_cache``) before it arrives here; a model cast to another dtype
    after the cache was used would attend its new queries against K/V of the old one.
    """
    batch = slots.positions.shape[0]
    if key_states.shape[0] != batch:
        raise ValueError(f"cache: this ScissorhandsCache holds {batch} sequence(s), but is continued by a batch of "
                         f"{key_states.shape[0]}; continue it with the same rows, or call cache.reset() or build "
                         "a new cache")
    if key_states.dtype != dtype:
        raise ValueError(f"cache: this ScissorhandsCache holds K/V computed in {dtype}, but the model now computes "
                         f"in {key_states.dtype} (cast after the cache was used?); call cache.reset() or build a "
                         "new cache")


def check_continues(slots: SlotTable, key_states: torch.Tensor, position_ids) -> None:
    """A used cache takes only input that continues it: positions at or after the tokens it has seen.

    An independent prompt given to a used cache starts again at position 0
    (or, when generate() feeds it whole, at positions the cache already
    holds); that is a one-line ``ValueError`` naming ``cache``. Decoding steps
    on an accelerator are not checked (one token, and reading the positions
    would synchronise the device).

    Parameters
    ----------
    slots : SlotTable
        The layer's slots (real tokens seen per row).
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.numel() == 0:
        return
    if key_states.shape[-2] == 1 and position_ids.device.type != "cpu":
        return
    most = slots.uniform[1] if slots.uniform is not None else int(slots.seen.max())
    if most > 0 and int(position_ids.max()) < most:
        raise ValueError(reuse_message(most))
