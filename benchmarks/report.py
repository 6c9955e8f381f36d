"""Result tables: printed, and written as Markdown sections of benchmarks/RESULTS.md plus CSV files."""
from __future__ import annotations

import csv
import datetime
import platform
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"


def machine() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=HERE).stdout.strip()
    except OSError:
        commit = "unknown"
    import os

    import torch
    return (f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), Python {platform.python_version()}, "
            f"torch {torch.__version__}, commit {commit}, {datetime.date.today().isoformat()}")


def table(headers, rows) -> str:
    text = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)] if text else [len(h) for h in headers]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in text]
    return "\n".join(lines)


def write_section(name: str, title: str, body: str, headers=None, rows=None) -> None:
    """Replace (or add) the `name` section of RESULTS.md; write name.csv when rows are given."""
    section = f"<!-- {name} -->\n## {title}\n\n_Machine: {machine()}_\n\n{body}\n<!-- /{name} -->\n"
    text = RESULTS.read_text() if RESULTS.exists() else "# autoshard benchmark results\n\n"
    start, end = text.find(f"<!-- {name} -->"), text.find(f"<!-- /{name} -->")
    if start >= 0 and end >= 0:
        text = text[:start] + section + text[end + len(f"<!-- /{name} -->\n"):]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text)
    if rows is not None:
        write_csv(name, headers, rows)
    print(section)


def write_csv(name: str, headers, rows) -> None:
    """benchmarks/<name>.csv beside RESULTS.md."""
    with open(HERE / f"{name}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(headers)
        writer.writerows(rows)
