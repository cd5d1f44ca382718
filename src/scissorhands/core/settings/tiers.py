"""Demotion tiers: the chain of K/V widths ``kv_demote`` names (``"16:0.2,4:0.5"``), its checks, and each
width's share of a layer's budget in tokens. Read by the settings (to check them) and by the tiered store (to
size its pools); framework-free."""

from __future__ import annotations

import numbers

# The packed widths a chain may step through; each step's plane is 2 or 4 bits wide.
PACKED_CHAIN = (8, 4, 2)


def parse_tiers(spec) -> tuple[tuple[int, float], ...]:
    """``"16:0.2,4:0.5"`` (or a list of pairs) as ``((16, 0.2), (4, 0.5))``: widths above ``kv_bits``, each with
    the most tokens of a layer's budget (a fraction) that may hold that width or more.

    ``;`` separates pairs as ``,`` does (``16:0.2;4:0.5``): lm-eval splits its ``--model_args`` at commas. A
    width is an integer: ``8.7`` is refused, as a float is for every integer setting."""
    if isinstance(spec, str):
        pairs = []
        for part in spec.replace(" ", "").replace(";", ",").split(","):
            bits, sep, share = part.partition(":")
            if not sep:
                raise ValueError(f"kv_demote: must be BITS:SHARE pairs such as 16:0.2,4:0.5, got {spec!r}")
            try:
                pairs.append((int(bits), float(share)))
            except ValueError:
                raise ValueError(f"kv_demote: must be BITS:SHARE pairs such as 16:0.2,4:0.5, got {spec!r}") from None
        return tuple(pairs)
    if isinstance(spec, (list, tuple)):
        try:
            pairs = [(b, float(f)) for b, f in spec]
        except (TypeError, ValueError):
            raise ValueError(f"kv_demote: must be (bits, share) pairs, got {spec!r}") from None
        for b, _ in pairs:
            if isinstance(b, bool) or not isinstance(b, numbers.Integral):
                raise ValueError(f"kv_demote: a width must be an integer number of bits, got {b!r}")
        return tuple((int(b), f) for b, f in pairs)
    raise ValueError(f"kv_demote: must be BITS:SHARE pairs such as 16:0.2,4:0.5, got {spec!r}")


def check_tiers(tiers: tuple[tuple[int, float], ...], base_bits) -> None:
    """Raise a one-line ``ValueError`` naming ``kv_demote`` unless the chain ``tiers`` over ``base_bits`` is valid."""
    if not tiers:
        raise ValueError("kv_demote: give at least one BITS:SHARE pair above kv_bits")
    if base_bits not in (2, 4):
        raise ValueError(f"kv_demote: needs kv_bits 2 or 4 (the width demoted tokens end at), got {base_bits}")
    widths = [b for b, _ in tiers]
    if any(b not in (16, 8, 4, 2) for b in widths):
        raise ValueError(f"kv_demote: widths must be among 16, 8, 4, 2, got {widths}")
    chain = widths + [base_bits]
    if any(a <= b for a, b in zip(chain, chain[1:])):
        raise ValueError(f"kv_demote: widths must fall strictly, ending above kv_bits={base_bits}, got {widths}")
    packed = [b for b in chain if b < 16]
    want = list(PACKED_CHAIN[PACKED_CHAIN.index(packed[0]):PACKED_CHAIN.index(base_bits) + 1])
    if packed != want:
        raise ValueError(f"kv_demote: packed widths must step through {want} one by one (each step drops 2 or 4 "
                         f"bits of the same code), got {packed}")
    shares = [f for _, f in tiers]
    if any(not 0.0 < f < 1.0 for f in shares):
        raise ValueError(f"kv_demote: each share must be a fraction of the budget in (0, 1), got {shares}")
    if any(a > b for a, b in zip(shares, shares[1:])):
        raise ValueError(f"kv_demote: shares must not fall down the chain (a share counts every token at that "
                         f"width or wider), got {shares}")


def share_caps(tiers, budget: int) -> tuple[int, ...]:
    """Each width's share of a layer budget, in tokens (at least one)."""
    return tuple(max(1, round(share * budget)) for _, share in tiers)


def tier_caps(tiers, budget: int, recent: int, drop: int) -> tuple[int, ...]:
    """Each width's most tokens in a layer of this budget, or a one-line ``ValueError`` naming ``kv_demote``.

    The widest width must hold the recent window (never demoted) and a drop's worth more; the base must
    keep at least a drop's worth of tokens that only it holds (eviction takes them from there).
    """
    caps = share_caps(tiers, budget)
    need = recent + drop
    if caps[0] < need:
        raise ValueError(f"kv_demote: the {tiers[0][0]}-bit share holds {caps[0]} tokens of this layer's budget "
                         f"of {budget}, fewer than the recent window plus a drop ({recent} + {drop}); raise it to "
                         f"at least {need / budget:.3f}")
    if budget - caps[-1] < drop:
        raise ValueError(f"kv_demote: the {tiers[-1][0]}-bit share leaves {budget - caps[-1]} tokens of this "
                         f"layer's budget of {budget} below it, fewer than a drop ({drop}); lower it to at most "
                         f"{(budget - drop) / budget:.3f}")
    return caps
