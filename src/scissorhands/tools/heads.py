"""A model's KV heads ranked by how far back they look, measured once on real text (``scissorhands heads``).

The score is :func:`scissorhands.core.planning.heads.outside_mass`: the attention a head's queries pay outside
the sinks and recent window a streaming head keeps, under the full cache. The model runs the text in segments
with its attention probabilities written out (the eager attention of transformers, switched for the
measurement and back after it).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import torch

from scissorhands.core.planning.heads import HeadRanking, outside_mass
from scissorhands.core.settings.heads import DEFAULT_LENGTH, DEFAULT_RECENT, STREAMING_SINKS
from scissorhands.hf.modelinfo import model_facts


def default_text() -> tuple[str, str]:
    """Python source, since code is where head budgets matter: the standard library's ``inspect`` module, which
    ships with every Python and is no benchmark's test set. Returns (name, text)."""
    path = Path(inspect.getsourcefile(inspect) or "")
    version = ".".join(map(str, sys.version_info[:2]))
    return f"the inspect module of Python {version}'s standard library", path.read_text()


def measure_heads(model, ids: list[int], *, name: str, text: str, sinks: int = STREAMING_SINKS,
                  recent: int = DEFAULT_RECENT, length: int = DEFAULT_LENGTH) -> HeadRanking:
    """Each budgeted layer's KV heads scored on ``ids``, run in segments of ``length`` tokens.

    Parameters
    ----------
    model : PreTrainedModel
    ids : list of int
        The calibration text's tokens.
    name, text : str
        The model's and the text's names, kept in the ranking.
    sinks, recent : int
        The streaming restriction measured against.
    length : int
        Tokens run at once (the attention probabilities of a segment are held: layers x heads x length²).

    Returns
    -------
    HeadRanking
        The scores: per KV head, the mass outside averaged over every segment's counted queries.
    """
    facts = model_facts(model)
    config = model.config
    query_heads = int(config.num_attention_heads)
    g = query_heads // facts.num_kv_heads
    segments = [ids[i : i + length] for i in range(0, len(ids), length)]
    segments = [s for s in segments if len(s) > sinks + recent]  # a segment must have a query to count
    if not segments:
        raise ValueError(f"tokens: the text must have more than sinks + recent ({sinks + recent}) tokens")
    totals = torch.zeros(len(facts.full_layers), facts.num_kv_heads, dtype=torch.float64)
    counted = 0
    before = config._attn_implementation
    model.set_attn_implementation("eager")  # the one implementation that writes its probabilities out
    try:
        for seg in segments:
            with torch.no_grad():
                out = model(torch.tensor([seg], device=model.device), output_attentions=True, use_cache=False,
                            logits_to_keep=1)
            n = len(seg) - sinks - recent  # queries with a key outside the window
            for i, layer in enumerate(facts.full_layers):
                probs = out.attentions[layer][0]  # (H_q, T, T)
                grouped = probs.view(facts.num_kv_heads, g, len(seg), len(seg))  # (H_kv, g, T, T)
                totals[i] += outside_mass(grouped, sinks, recent) * n
            counted += n
            del out
    finally:
        if config._attn_implementation != before:
            model.set_attn_implementation(before)
    scores = (totals / counted).tolist()
    return HeadRanking(name, str(getattr(config, "model_type", "")), tuple(facts.full_layers), facts.num_kv_heads,
                       query_heads, tuple(tuple(round(x, 6) for x in row) for row in scores), sinks, recent, text,
                       sum(len(s) for s in segments))
