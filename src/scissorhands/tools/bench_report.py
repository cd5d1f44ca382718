"""``scissorhands bench``'s Markdown tables and plots, from the result a run returns."""

from __future__ import annotations

import logging
from pathlib import Path

from .bench_config import BenchConfig, budget_tokens, parse_size  # noqa: F401  (the bench's public names)

logger = logging.getLogger(__name__)


def tables(result: dict) -> str:
    """Markdown tables of a :func:`run_bench` result."""
    lines: list[str] = []
    if result.get("decode"):
        if result.get("config", {}).get("repeat_rows"):
            lines += ["Rows are one prompt's caches repeated (`--repeat-rows`): \"prefill s\" is that one row's.", ""]
        lines += ["| context | batch | variant | tokens held | step ms (median) | tokens/s | prefill s |",
                  "|---|---|---|---|---|---|---|"]
        for point in result["decode"]:
            for v in point["variants"]:
                held = v["budget"] if v["budget"] is not None else v["context"]
                lines.append(f"| {point['context']} | {point['batch']} | {v['name']} | {held} | "
                             f"{v['step_s'] * 1e3:.1f} | {v['tokens_per_s']:.1f} | {v['prefill_s']:.2f} |")
        lines += ["", "| context | batch | budget | ours tok/s | full at budget tok/s | vs reference | "
                  "full at context tok/s | vs full |", "|---|---|---|---|---|---|---|---|"]
        for point in result["decode"]:
            for r in point["ratios"]:
                label = "" if r.get("method", "scissorhands") == "scissorhands" else f"{r['method']} "
                spec = r["fraction"] if isinstance(r["fraction"], str) else f"{r['fraction']:g}"
                lines.append(f"| {point['context']} | {point['batch']} | {label}{spec} ({r['budget']}) | "
                             f"{r['tokens_per_s']:.1f} | {r['reference_tokens_per_s']:.1f} | {r['vs_reference']:.2f} | "
                             f"{r['full_tokens_per_s']:.1f} | {r['vs_full']:.2f} |")
        lines += ["", "| context | batch | variant | KV bytes (storage) | analytic | importance bytes | analytic | "
                  "match |", "|---|---|---|---|---|---|---|---|"]
        for point in result["decode"]:
            for v in point["variants"]:
                m, a = v["measured"], v["analytic"]
                lines.append(f"| {point['context']} | {point['batch']} | {v['name']} | {m['kv_bytes']:,} | "
                             f"{a['kv_bytes']:,} | {m['importance_bytes']:,} | {a['importance_bytes']:,} | "
                             f"{'yes' if v['bytes_match'] else 'NO'} |")
        lines.append("")
    if result.get("prefill"):
        lines += ["| prompt | variant | prefill s (median) | ratio to SDPA |", "|---|---|---|---|"]
        for r in result["prefill"]:
            lines.append(f"| {r['context']} | {r['variant']} | {r['seconds']:.3f} | {r['ratio_to_sdpa']:.2f} |")
        lines.append("")
    if result.get("maxbatch"):
        lines += ["| variant | budget | max batch | x full | decode tok/s at max batch | x full | used MiB |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["maxbatch"]:
            br = f"{r['batch_ratio']:.2f}" if r["batch_ratio"] is not None else "-"
            tr = f"{r['tokens_per_s_ratio']:.2f}" if r["tokens_per_s_ratio"] is not None else "-"
            tps = f"{r['tokens_per_s_at_max']:.1f}" if r["tokens_per_s_at_max"] else "-"
            used = f"{r['used_bytes_at_max'] / 2**20:.1f}" if r["used_bytes_at_max"] is not None else "-"
            more = " (limit)" if r["hit_limit"] else ""
            lines.append(f"| {r['variant']} | {r['budget'] or '-'} | {r['max_batch']}{more} | {br} | {tps} | {tr} | "
                         f"{used} |")
        lines.append("")
    if result.get("soak"):
        s = result["soak"]
        lines.append(f"soak: {s['tokens']} tokens at budget {s['budget']}: cache bytes flat after fill: {s['flat']}; "
                     f"RSS growth after fill {s.get('rss_growth_after_fill', float('nan')):+.2%}; "
                     f"tokens/s last/first {s.get('speed_window_tokens', 0)} tokens "
                     f"{s.get('speed_last_over_first', float('nan')):.3f}")
    if "peak_rss_bytes" in result:
        lines.append(f"peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB")
    if result.get("interrupted"):
        lines.append("interrupted: only the points above were measured")
    return "\n".join(lines)


def plot(result: dict, out_dir) -> list[str]:
    """PNG plots: throughput against context, memory against tokens generated, max batch against budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written = []
    if result.get("decode"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for batch in sorted({p["batch"] for p in result["decode"]}):
            points = [p for p in result["decode"] if p["batch"] == batch]
            names = [v["name"] for v in points[0]["variants"] if "reference_for" not in v]
            drawn: set = set()  # one reference line per budget, however many methods share it
            for name in names:
                xs = [p["context"] for p in points]
                ys = [next(v["tokens_per_s"] for v in p["variants"] if v["name"] == name) for p in points]
                line, = ax.plot(xs, ys, marker="o", label=f"{name}, batch {batch}")
                fraction = next((v.get("fraction") for v in points[0]["variants"] if v["name"] == name), None)
                refs = [(p["context"], v["tokens_per_s"]) for p in points for v in p["variants"]
                        if fraction is not None and v.get("reference_for") == fraction]
                if refs and fraction not in drawn:  # the reference point: the full cache at context = budget
                    drawn.add(fraction)
                    ax.plot([x for x, _ in refs], [y for _, y in refs], marker="s", ls=":", color=line.get_color(),
                            alpha=0.7, label=f"full cache at the budget of {name}, batch {batch}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title("Decode throughput against context")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "throughput.png", dpi=120)
        plt.close(fig)
        written.append("throughput.png")
    if result.get("soak"):
        s = result["soak"]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [r["tokens"] for r in s["records"]]
        ax.plot(xs, [r["cache_bytes"] / 2**20 for r in s["records"]], marker=".", label="cache (K/V + state), MiB")
        if all(r["rss_bytes"] is not None for r in s["records"]):
            ax.plot(xs, [r["rss_bytes"] / 2**20 for r in s["records"]], marker=".", label="process RSS, MiB")
        ax.set_xlabel("tokens generated")
        ax.set_ylabel("MiB")
        ax.set_title(f"Memory over a long generation (budget {s['budget']})")
        ax2 = ax.twinx()
        ax2.plot(xs, [r["tokens_per_s"] for r in s["records"]], color="gray", linestyle="--", label="tokens/s")
        ax2.set_ylabel("tokens/s")
        ax.legend(loc="center left", fontsize=7)
        ax2.legend(loc="center right", fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "memory.png", dpi=120)
        plt.close(fig)
        written.append("memory.png")
    if result.get("maxbatch"):
        fig, ax = plt.subplots(figsize=(6, 4))
        rows = result["maxbatch"]
        ax.bar([r["variant"] for r in rows], [r["max_batch"] for r in rows])
        ax.set_ylabel("largest batch under the cap")
        ax.set_title(f"Max batch under {result['config']['cap_memory'] / 2**20:.0f} MiB")
        fig.tight_layout()
        fig.savefig(out_dir / "max_batch.png", dpi=120)
        plt.close(fig)
        written.append("max_batch.png")
    return written
