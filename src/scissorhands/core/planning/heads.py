"""Head-level budgets: a ranking of KV heads measured once per model, and the budget each head gets from it.

Some attention heads look far back (they retrieve), most attend to the first tokens and the last few. Giving
whole heads unequal budgets keeps what the retrieval heads need at the cost of the others, where one budget for
every head makes them all lose the same share. This follows DuoAttention (Xiao et al., 2024) and
RazorAttention (Tang et al., 2024): retrieval heads keep a large cache, streaming heads only attention sinks
and a recent window.

**The score** (:func:`outside_mass`). DuoAttention ranks a head by how much its output changes when it is
restricted to sinks and a recent window. The attention a query would lose under that restriction bounds the
change: with ``m`` the probability mass outside the kept tokens, the restricted output differs from the full one
by at most ``2·m·max‖v‖``. So a KV head's score is that mass, measured with the full cache on real text:
averaged over the query heads that share the KV head and over every query that has a token outside
``sinks`` + ``recent``. A head that looks far back scores high; a streaming head scores near 0.

**The budgets** (:func:`head_budgets`). The ``share`` of all budgeted KV heads with the highest scores, ranked
across layers, are retrieval heads; each other head holds ``window`` tokens. The total stays the uniform
cache's, ``Σ_ℓ H·B_ℓ``: what the streaming heads give up goes to the retrieval heads, in proportion to their
layer's budget and floored. With a uniform schedule a retrieval head holds
``B_hi = ⌊(H_total·B − n_lo·w) / n_hi⌋``, so the mean over all heads is at most ``B``.

**The file** (:class:`HeadRanking`): JSON written by ``scissorhands heads``, checked against the model it is
used with.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "scissorhands-heads/1"


@dataclass(frozen=True)
class HeadRanking:
    """Retrieval scores of every budgeted layer's KV heads, and what they were measured on.

    Attributes
    ----------
    model : str
        The model's name, as given to the command.
    model_type : str
    layers : tuple of int
        The budgeted (full-attention) layers' indices.
    kv_heads, query_heads : int
    scores : tuple of tuple of float
        ``scores[i][h]``: KV head ``h`` of layer ``layers[i]``.
    sinks, recent : int
        The streaming restriction the scores measure against.
    text : str
        The calibration text (its name); ``tokens``: how many of its tokens were run.
    """

    model: str
    model_type: str
    layers: tuple[int, ...]
    kv_heads: int
    query_heads: int
    scores: tuple[tuple[float, ...], ...]
    sinks: int
    recent: int
    text: str
    tokens: int

    def record(self) -> dict:
        """The JSON object :meth:`load` reads."""
        return {"format": FORMAT, "model": self.model, "model_type": self.model_type, "layers": list(self.layers),
                "kv_heads": self.kv_heads, "query_heads": self.query_heads, "sinks": self.sinks,
                "recent": self.recent, "text": self.text, "tokens": self.tokens,
                "scores": [list(row) for row in self.scores]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.record(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, name: str = "head_budgets") -> HeadRanking:
        """Read a ranking file; a one-line ``ValueError`` naming ``name`` if it is missing or malformed."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"{name}: no such file {str(p)!r}")
        try:
            data = json.loads(p.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{name}: {str(p)!r} is not a JSON head ranking") from None
        except OSError as e:
            raise ValueError(f"{name}: cannot read {str(p)!r} ({e.strerror or e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{name}: {str(p)!r} is not a head ranking (format {FORMAT!r}, written by "
                             "`scissorhands heads`)")
        try:
            layers = tuple(_whole(x) for x in data["layers"])
            kv, hq = _whole(data["kv_heads"]), _whole(data["query_heads"])
            scores = tuple(tuple(_finite(x) for x in row) for row in data["scores"])
            out = cls(str(data["model"]), str(data["model_type"]), layers, kv, hq, scores, _whole(data["sinks"]),
                      _whole(data["recent"]), str(data["text"]), _whole(data["tokens"]))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{name}: {str(p)!r} is a malformed head ranking (layers, kv_heads, query_heads, "
                             "scores, sinks, recent, text, tokens)") from None
        if kv < 1 or len(scores) != len(layers) or any(len(row) != kv for row in scores):
            raise ValueError(f"{name}: {str(p)!r} must hold {kv} scores for each of its {len(layers)} layers")
        return out

    def check_model(self, model_type: str | None, layers: list[int], kv_heads: int, name: str = "head_budgets"):
        """A one-line ``ValueError`` unless this ranking was measured on a model of this shape."""
        have = f"{len(self.layers)} budgeted layers of {self.kv_heads} KV heads ({self.model_type}, {self.model!r})"
        want = f"{len(layers)} budgeted layers of {kv_heads} KV heads ({model_type})"
        if list(self.layers) != list(layers) or self.kv_heads != kv_heads or (
                model_type is not None and model_type != self.model_type):
            raise ValueError(f"{name}: the ranking was measured on another model ({have}); this model has {want}: "
                             "run `scissorhands heads` on it")


def _whole(x) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise ValueError(x)
    return x


def _finite(x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(x)
    return float(x)


def retrieval_heads(scores: list[list[float]] | tuple[tuple[float, ...], ...], share: float) -> list[list[bool]]:
    """Which KV heads are retrieval heads: the ``share`` of all of them (at least one) with the highest scores,
    ranked across layers; ties go to the earlier layer, then the lower head."""
    flat = [(-s, i, h) for i, row in enumerate(scores) for h, s in enumerate(row)]
    n_hi = max(1, min(len(flat), round(share * len(flat))))
    chosen = {(i, h) for _, i, h in sorted(flat)[:n_hi]}
    return [[(i, h) in chosen for h in range(len(row))] for i, row in enumerate(scores)]


def head_budgets(retrieval: list[list[bool]], budgets: list[int], windows: list[int]) -> list[list[int]]:
    """Each KV head's budget: ``windows[ℓ]`` for a streaming head of layer ℓ, and for a retrieval head its share of
    what is left of the uniform total ``Σ_ℓ H_ℓ·budgets[ℓ]``, in proportion to ``budgets[ℓ]``, floored.

    Every retrieval head gets at least its layer's budget (each window is below it), and the budgets add up to
    at most the uniform total.
    """
    total = sum(len(row) * b for row, b in zip(retrieval, budgets))
    streaming = sum(w for row, w in zip(retrieval, windows) for hi in row if not hi)
    weight = sum(b for row, b in zip(retrieval, budgets) for hi in row if hi)
    out = []
    for row, b, w in zip(retrieval, budgets, windows):
        high = (total - streaming) * b // weight if weight else b
        out.append([high if hi else w for hi in row])
    return out


def head_groups(budgets: list[int], retrieval: list[bool]) -> list[tuple[tuple[int, ...], int, bool]]:
    """One layer's KV heads grouped by (budget, retrieval or not): ``(heads, budget, retrieval)`` per group, the
    heads ascending, the groups in the order of their first head."""
    groups: dict[tuple[int, bool], list[int]] = {}
    for h, (b, hi) in enumerate(zip(budgets, retrieval)):
        groups.setdefault((b, hi), []).append(h)
    return [(tuple(heads), b, hi) for (b, hi), heads in groups.items()]


def outside_mass(probs: torch.Tensor, sinks: int, recent: int) -> torch.Tensor:
    """Each KV head's retrieval score: the attention mass its queries pay outside ``sinks`` + ``recent``.

    Parameters
    ----------
    probs : Tensor, shape (H_kv, g, T, T)
        One sequence's causal attention probabilities, grouped by KV head (``g`` query heads share one);
        query ``t`` over keys ``0..T-1``.
    sinks, recent : int
        The first ``sinks`` positions and, for query ``t``, the positions ``t - recent + 1 .. t`` are kept by a
        streaming head.

    Returns
    -------
    Tensor, shape (H_kv,), float64: the mass outside, averaged over the ``g`` query heads and over the queries
    ``t >= sinks + recent`` (those with a key outside); zeros when there is no such query.
    """
    t = probs.shape[-1]
    q = torch.arange(t, device=probs.device)[:, None]  # (T, 1) query index
    k = torch.arange(t, device=probs.device)[None, :]  # (1, T) key index
    outside = (k >= sinks) & (k <= q - recent)  # (T, T): neither a sink nor in the query's recent window
    lost = (probs.double() * outside).sum(dim=-1)  # (H_kv, g, T)
    counted = torch.arange(t, device=probs.device) >= sinks + recent  # (T,)
    if not bool(counted.any()):
        return torch.zeros(probs.shape[0], dtype=torch.float64)
    return lost[..., counted].mean(dim=(1, 2)).cpu()
