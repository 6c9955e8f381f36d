"""Optional PNG charts beside the CSVs; matplotlib is not a dependency, so without it this prints a note."""
from __future__ import annotations

from .report import HERE


def line_chart(name: str, title: str, xlabel: str, ylabel: str, x, series: dict, logx: bool = False) -> None:
    """benchmarks/<name>.png: one line per {label: [y per x]}."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"[benchmarks] matplotlib is not installed: skipped {name}.png (the CSV has the same figures)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, ys in series.items():
        ax.plot(x, ys, marker="o", label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend()
    fig.tight_layout()
    fig.savefig(HERE / f"{name}.png", dpi=100)
    plt.close(fig)
