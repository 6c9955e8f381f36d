"""The memory part of a plan's summary: the predicted breakdown per rank and the memory savers it uses.

>>> print(memory_lines({"memory_bytes_per_rank": 3 * 2**30, "memory": {"params": 2**30, "activations": 2 * 2**30}},
...                    {"zero": {"dp": 3}})[1])
  memory savers: ZeRO-3 on 'dp'
"""
from __future__ import annotations

_NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state",
          "gathered": "ZeRO-3 gathered parameters", "inputs": "inputs", "activations": "saved activations"}


def memory_lines(predicted: dict, hints: dict) -> list[str]:
    """The breakdown line (plans made before it was predicted have none) and the savers the plan's hints
    record (ZeRO, recomputed layers). The budget is the compile's option, not the plan's: a loaded plan
    prints the same.

    >>> memory_lines({"memory_bytes_per_rank": 2**20, "memory": {"inputs": 2**20}}, {})
    ['  memory per rank 1.0 MiB: inputs 1.0 MiB']
    """
    parts = predicted.get("memory")
    if not parts:
        return []
    shown = ", ".join(f"{label} {size(parts[key])}" for key, label in _NAMES.items() if parts.get(key))
    lines = [f"  memory per rank {size(predicted['memory_bytes_per_rank'])}: {shown}"]
    savers = [f"ZeRO-{stage} on {axis!r}" for axis, stage in hints.get("zero", {}).items()]
    recomputed = hints.get("recompute", [])
    if recomputed:
        savers.append(f"{len(recomputed)} regions recomputed in backward ({', '.join(recomputed[:3])}"
                      f"{', ...' if len(recomputed) > 3 else ''})")
    if savers:
        lines.append("  memory savers: " + "; ".join(savers))
    return lines


def size(nbytes) -> str:
    """Bytes in the unit a person reads best: GiB from 1 GiB, else MiB.

    >>> size(3 * 2**30), size(5 * 2**20)
    ('3.00 GiB', '5.0 MiB')
    """
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
