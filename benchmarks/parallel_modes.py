"""Benchmark 6 (issue 5): the other parallel modes against their papers' figures, in one section.

Tensor parallelism 2D / 2.5D / 3D: bytes per Llama layer per mesh axis, counted by the runtime and
predicted by the cost model, against the formulas derived from SUMMA/Optimus, Tesseract and 3D
(benchmarks/tp_modes.py). ZeRO: bytes per rank of parameters, gradients and optimizer state on dp=4,
measured and predicted (benchmarks/zero_memory.py). Both run in the simulator (bit-identical to gloo).
"""
from __future__ import annotations

from . import tp_modes, zero_memory
from .report import table, write_csv, write_section


def main(quick: bool = False) -> None:
    rows = tp_modes.table_rows()
    matched = sum(r[5] == "yes" for r in rows)
    zero_head, zero_rows = zero_memory.table_rows("gpt2")
    check = zero_memory.check_line(zero_memory.zero3_check("gpt2"))
    body = (f"Target (issue 5): counted communication per layer of 2D, 2.5D and 3D tensor parallelism equals the "
            f"papers' formulas for the same shapes; ZeRO-3's per-rank memory on dp=4 within 5% of 1/4 of the "
            f"replicated figure plus the largest gathered layer, predicted within 10%. **{matched} of {len(rows)} "
            f"mesh axes match the papers exactly (predicted and counted).**\n\n"
            f"Bytes per Llama layer per rank and step (float64, 8 x 16 tokens, dim 32, FFN 64), one layer = a "
            f"2-layer plan minus a 1-layer plan; counted = the runtime's collective counter (all directions); "
            f"predicted and paper-derived split into forward / backward / gradient sync after backward.\n\n"
            f"{table(tp_modes.HEAD, rows)}\n\n"
            f"GPT-2 on dp=4: bytes per rank after one Adam step (rank 0; offload: optimizer state on the CPU).\n\n"
            f"{table(zero_head, zero_rows)}\n\n{check}\n")
    write_csv("parallel_modes_zero", zero_head, zero_rows)
    write_section("parallel_modes", "6. Parallel modes vs their papers: 2D/2.5D/3D communication, ZeRO memory",
                  body, tp_modes.HEAD, rows)
