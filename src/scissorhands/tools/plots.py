"""Pictures of what a cache holds (matplotlib, drawn off screen)."""

from __future__ import annotations

from pathlib import Path

from scissorhands.core.layer.audit import held_map


def plot_held_map(cache, path: str | Path, row: int = 0, spans: dict[str, tuple[int, int]] | None = None) -> None:
    """A PNG heat map of kept (bright) against evicted (dark) positions by layer, at the end of generation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = held_map(cache, row)
    layers = sorted(layer.layer_idx for layer in cache.budgeted_layers if layer.kv.allocated)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    im = ax.imshow(grid.numpy(), aspect="auto", interpolation="nearest", cmap="magma", vmin=0, vmax=1)
    ax.set_xlabel("token position")
    ax.set_ylabel("layer")
    if layers:
        step = max(1, len(layers) // 10)
        ax.set_yticks(range(0, len(layers), step), [str(x) for x in layers[::step]])
    seen = grid.shape[1]
    spans = dict(spans or {})
    prompt = spans.pop("prompt", None)
    top = ("data", "axes fraction")
    if prompt is not None and prompt[1] < seen:  # label the prompt and the generated tokens above the map
        cut = prompt[1]
        ax.axvline(cut - 0.5, color="white", lw=1.2, ls="--")
        for text, lo, hi in ((f"prompt [0, {cut})", 0, cut), (f"generated [{cut}, {seen})", cut, seen)):
            ax.annotate(text, xy=((lo + hi) / 2 - 0.5, 1.0), xycoords=top, xytext=(0, 3),
                        textcoords="offset points", ha="center", va="bottom", fontsize=8, color="black")
    for i, (name, (start, end)) in enumerate(spans.items()):
        if start == 0 and end >= seen - 1:
            continue  # a span covering everything marks nothing
        if start == 0:  # a prefix: its end is the line that matters
            ax.axvline(end - 0.5, color="cyan", lw=1, ls="--")
        else:
            ax.axvspan(start - 0.5, end - 0.5, fill=False, edgecolor="cyan", lw=1)
        ax.annotate(f"{name} [{start}, {end})", xy=(end, 0), xycoords=top, xytext=(3, 4 + 10 * i),
                    textcoords="offset points", fontsize=8, color="cyan")
    fig.colorbar(im, ax=ax, label="fraction of KV heads holding the token")
    ax.set_title("Tokens held at the end of generation, by layer", pad=16)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
