"""Frozen, validated settings of one analysis run.

Every bad value raises ``ValueError`` whose message starts with the name of
the command-line option that sets it.
"""

from __future__ import annotations

from dataclasses import dataclass

from scissorhands.core.settings.config import check_int

PARTS = ("persistence", "powerlaw", "calibrate", "bound", "ppl")


@dataclass(frozen=True)
class AnalysisSettings:
    """What :func:`scissorhands.tools.analysis.pipeline.analyze` measures.

    Parameters
    ----------
    seq_lens : tuple of int
        Lengths T at which persistence is measured. One forward at the largest
        gives every shorter length too: with causal attention the first T'
        rows and columns of the map are exactly the map of the T'-token prefix.
        Power law and the bound use the largest.
    windows : int
        Calibration-text windows for persistence and power law.
    thresholds : tuple of float
        Form (a) thresholds, as multiples of ``1 / n_t``.
    topk : tuple of float
        Form (b) top-set sizes, as fractions of the first half.
    calib_topk : float
        The form (b) size that drives calibration (must be in ``topk``).
    budget : float
        Average budget at which the calibrated schedule is written: a fraction
        of ``ppl_seq_len`` (<= 1) or a token count (> 1).
    weight_floor : float
        Added to each layer's weight ``1 - persistence``.
    ratios : tuple of float
        Values of B/T for the bound analysis, each in (0, 1].
    bound_windows : int
        Evaluation windows for the bound analysis.
    ppl_seq_len, ppl_windows : int
        Evaluation windows for the schedule comparison.
    compressions : tuple of float
        Compression factors (T / average budget) for the schedule comparison.
    calib_fraction : float
        Share of the corpus tokens (from the start) used for calibration; the
        rest is used for evaluation, so the two never overlap.
    rank_lo : int
        First rank of the power-law fit; the last is T/2.
    seed : int
        Seed of the randomly initialised control model.
    bos : bool
        Start every window with the tokenizer's BOS token (then ``T - 1`` text
        tokens). Models such as Gemma 3 expect it; without it their
        perplexity on these windows is several times higher.
    parts : tuple of str
        Which of :data:`PARTS` to run.
    """

    seq_lens: tuple[int, ...] = (256, 512, 1024)
    windows: int = 8
    thresholds: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0)
    topk: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3)
    calib_topk: float = 0.1
    budget: float = 0.2
    weight_floor: float = 0.1
    ratios: tuple[float, ...] = (0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
    bound_windows: int = 2
    ppl_seq_len: int = 2048
    ppl_windows: int = 16
    compressions: tuple[float, ...] = (3.0, 5.0)
    calib_fraction: float = 0.5
    rank_lo: int = 2
    seed: int = 0
    bos: bool = False
    parts: tuple[str, ...] = PARTS

    def __post_init__(self):
        for name in ("seq_lens", "thresholds", "topk", "ratios", "compressions", "parts"):
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
            if not getattr(self, name):
                raise ValueError(f"{name.replace('_', '-')}: is empty")
        for t in self.seq_lens:
            check_int("seq-len", t, 16)
        check_int("num-samples", self.windows, 1)
        for m in self.thresholds:
            if not m > 0:
                raise ValueError(f"thresholds: must be > 0, got {m:g}")
        for k in self.topk:
            if not 0.0 < k <= 1.0:
                raise ValueError(f"topk: must be in (0, 100] percent, got {k * 100:g}")
        if self.calib_topk not in self.topk:
            raise ValueError(f"topk: must include the calibration size {self.calib_topk * 100:g}%")
        if not self.budget > 0 or (self.budget > 1 and self.budget != int(self.budget)):
            raise ValueError(f"budget: must be a fraction in (0, 1] or a whole token count, got {self.budget:g}")
        if not self.weight_floor >= 0:
            raise ValueError(f"weight-floor: must be >= 0, got {self.weight_floor:g}")
        for r in self.ratios:
            if not 0.0 < r <= 1.0:
                raise ValueError(f"ratios: must be in (0, 1], got {r:g}")
        check_int("bound-samples", self.bound_windows, 1)
        check_int("ppl-seq-len", self.ppl_seq_len, 16)
        check_int("ppl-samples", self.ppl_windows, 1)
        for c in self.compressions:
            if not c >= 1.0:
                raise ValueError(f"compressions: must be >= 1, got {c:g}")
        if not 0.0 < self.calib_fraction < 1.0:
            raise ValueError(f"calib-fraction: must be in (0, 1), got {self.calib_fraction:g}")
        check_int("rank-lo", self.rank_lo, 1)
        if self.rank_lo > max(self.seq_lens) // 2 - 2:
            raise ValueError(f"rank-lo: must be <= T/2 - 2 = {max(self.seq_lens) // 2 - 2}, got {self.rank_lo}")
        check_int("seed", self.seed, 0)
        unknown = [p for p in self.parts if p not in PARTS]
        if unknown:
            raise ValueError(f"parts: unknown {unknown}; choose from {', '.join(PARTS)}")
        if "calibrate" in self.parts and "persistence" not in self.parts:
            raise ValueError("parts: 'calibrate' needs 'persistence'")

    @property
    def length(self) -> int:
        """The forward length used for attention maps, power law and the bound."""
        return max(self.seq_lens)
