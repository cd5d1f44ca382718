"""Eviction policies: how much each stored token is worth keeping.

A policy only scores. Selection (drop the lowest scores, never the recent
window, padding first, ties towards keeping the more recent token) and the
gather that compacts K/V and their state live once, in the cache layer.
"""

from __future__ import annotations

import torch


class EvictionPolicy:
    """Base class: override :meth:`scores`.

    ``tracks_attention`` tells the layer whether to accumulate attention
    into its importance state; policies that ignore attention skip that work.
    """

    name = "base"
    tracks_attention = True

    def scores(self, layer, length: int) -> torch.Tensor:
        """Keep-worthiness of the first ``length`` stored slots.

        Parameters
        ----------
        layer : ScissorhandsLayer
            The layer whose tokens are scored (``layer.importance``, ``layer.positions``).
        length : int
            Number of stored slots.

        Returns
        -------
        Tensor, shape (B, H_kv, length), float32
            Higher means keep. Padding and the recent window are handled by the layer.
        """
        raise NotImplementedError


class ImportancePolicy(EvictionPolicy):
    """Scissorhands: attention accumulated over the history window (``sum`` or ``count``)."""

    name = "scissorhands"

    def scores(self, layer, length: int) -> torch.Tensor:
        return layer.importance.scores(length)
