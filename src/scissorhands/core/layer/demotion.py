"""Demotion before eviction, for one budgeted layer: how many tokens each row holds at each width, the room
that leaves, and the demotion at every full width (the rules are :mod:`.budgeted`'s, "Tiers").

The layer owns one :class:`Demotion` when its store keeps a chain of bit widths
(:class:`~scissorhands.core.stores.tiered.TieredKVStore`, ``kv_demote``), and none otherwise.
"""

from __future__ import annotations

import torch

from ..stores.tiered import TieredKVStore
from ..tokens.selection import lowest


class Demotion:
    """One layer's widths above the base: their counts per row (CPU) and the demotion events."""

    def __init__(self, tiers: TieredKVStore):
        self.tiers = tiers
        self.counts = torch.zeros(0, 0, dtype=torch.long)  # (B, widths above the base): the fullest KV head's

    def allocate(self, batch: int) -> None:
        self.counts = torch.zeros(batch, len(self.tiers.tier_caps), dtype=torch.long)

    def reset(self) -> None:
        self.counts = torch.zeros(0, 0, dtype=torch.long)

    def added(self, tokens) -> None:
        """Each row took ``tokens`` new ones (an int, or (B,)): every new token holds every width."""
        self.counts += tokens if isinstance(tokens, int) else tokens[:, None]

    def room(self, free: torch.Tensor) -> torch.Tensor:
        """Tokens each row (B,) can take before its next event: the budget's ``free`` slots and every width's."""
        caps = torch.tensor(self.tiers.tier_caps)
        return torch.minimum(free, (caps[None, :] - self.counts).min(dim=1).values)

    def room_uniform(self, free: int) -> int:
        """:meth:`room` when every row is aligned, as one integer."""
        # Rows of equal length may differ in their widths' counts: the fullest decides (an event is a no-op for a
        # row with room left, since it evicts only at the budget and demotes only at a full width).
        return min(free, min(c - int(n) for c, n in zip(self.tiers.tier_caps, self.counts.amax(dim=0))))

    def ranked_for_eviction(self, scores: torch.Tensor) -> torch.Tensor:
        """Only tokens at the base width are evicted while any is left: wider ones rank above every score."""
        return scores.masked_fill(self.tiers.tier_mask(scores.shape[-1]), torch.finfo(scores.dtype).max)

    def demote(self, scores: torch.Tensor, rows: torch.Tensor, amount: int, lengths: torch.Tensor, recent: int,
               shield: torch.Tensor | None) -> None:
        """At each width whose cap a row of ``rows`` reached, demote its ``amount`` lowest ``scores`` a width down.

        The tokens at exactly that width go first and wider ones only when none is left: a wider token taken
        along would leave its own width's count short by a number that differs between KV heads, the heads'
        widths would then fill at different steps, and the events, which come when any head is full, would
        come every token or two instead of every ``amount``.

        ``lengths`` (B,) each row's stored tokens, ``recent`` the layer's recent window, ``shield`` the slots
        (B, H_kv, L) no eviction may drop: they are demoted only when nothing else is left.
        """
        tiers = self.tiers
        length = scores.shape[-1]
        device = scores.device
        counts = tiers.head_counts()  # (B, H_kv, levels): after the eviction
        rows_d = rows.to(device)[:, None]
        window = torch.clamp(lengths, max=recent).to(device)[:, None]  # (B, 1)
        # Shielded tokens go only when nothing else is left: above every score, below the recent window.
        top = torch.finfo(scores.dtype).max
        ranked = scores if shield is None else scores.masked_fill(shield, top)
        for level in reversed(range(len(tiers.tier_caps))):  # the widest pool first
            # Each KV head demotes at a width only when its own count there reached the cap.
            full = rows_d & (counts[..., level] >= tiers.tier_caps[level])  # (B, H_kv)
            if not bool(full.any()):
                continue
            holds = tiers.pools[level].where[:, :, :length] >= 0  # (B, H_kv, L): at this width or wider
            n = torch.where(full, torch.clamp(counts[..., level] - window, max=amount), 0)
            at_level = ranked
            if level > 0:  # tokens at exactly this width step down first; a wider one only when none is left
                wider = tiers.pools[level - 1].where[:, :, :length] >= 0
                at_level = ranked.masked_fill(wider & (ranked < top), top / 2)
            tiers.demote(level, lowest(at_level, lengths, recent, n, ~holds) & holds)
            counts = tiers.head_counts()
        self.counts = counts.amax(dim=1).cpu()

    def select_batch(self, index: torch.Tensor) -> None:
        self.counts = self.counts.index_select(0, index.cpu())

