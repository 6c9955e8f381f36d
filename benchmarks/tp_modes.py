"""Communication per transformer layer of 2D / 2.5D / 3D tensor parallelism: autoshard vs the papers.

For the zoo's Llama (dim 32, FFN 64, kv dim 16, batch 8 x seq 16 tokens, float64) on (2,2), (2,2,2)
depth 2 and (2,2,2): per mesh axis, the bytes one rank's collectives carry per training step for one
layer (a 2-layer model minus a 1-layer model), counted by the runtime in the simulator (the same
counter `verify --json` reports), predicted by the cost model, and derived from the papers' algorithms
(autoshard.frontend.tp_modes.layer_comm_formula, runtime counting convention). Run: python -m benchmarks.tp_modes
"""
from __future__ import annotations

from autoshard.frontend.tp_modes import (
    colossal_hints,
    layer_comm_formula,
    llama_layer_linears,
)
from autoshard.verify.verify import verify_simulated
from autoshard.zoo import llama

CASES = [("2d", 4, None, "SUMMA, Optimus arXiv 2104.05343"), ("2.5d", 8, 2, "Tesseract arXiv 2105.14500"),
         ("3d", 8, None, "3D, arXiv 2105.14450")]
NOTES = {
    ("2d", "row"): "paper-derived backward counts only the reductions: the papers also re-broadcast X and W "
                   "in backward (2x forward) where we keep the gathered panels from forward",
}


def per_layer(mode, size, depth):
    """{axis: (counted bytes, {fwd, bwd, sync} predicted)} of one layer: a 2-layer plan minus a 1-layer plan."""
    tp = colossal_hints("llama", dict(tensor=dict(size=size, mode=mode, depth=depth)))
    counted, predicted = [], []
    for layers in (1, 2):
        model, inputs, loss_fn = llama(n_layers=layers)
        report, prog = verify_simulated(model, inputs, loss_fn, mesh=tp.mesh_shape, axis_names=tp.axis_names,
                                        hints=tp.hints, steps=1)
        assert report.ok, report
        counted.append({a: sum(c["bytes"] for c in kinds.values()) for a, kinds in report.collectives.items()})
        predicted.append(prog.plan.predicted["comm_bytes_per_step"])
    one, two = predicted
    return {a: (counted[1].get(a, 0) - counted[0].get(a, 0), {d: two[a][d] - one[a][d] for d in two[a]})
            for a in tp.axis_names}


HEAD = ("mode (paper)", "axis", "counted", "predicted fwd / bwd / sync", "paper-derived fwd / bwd / sync", "match",
        "note")


def table_rows() -> list:
    """One row per (mode, mesh axis): counted and predicted bytes of one layer vs the paper's formula."""
    cfg = llama()[0].cfg
    linears = llama_layer_linears(cfg.dim, cfg.ffn_dim, cfg.n_kv_heads * cfg.head_dim)
    rows = []
    for mode, size, depth, source in CASES:
        formula = layer_comm_formula(mode, linears, tokens=8 * 16, q=2, depth=depth or 1)
        for axis, (counted, pred) in per_layer(mode, size, depth).items():
            expect = formula[axis]
            same = pred == expect and counted == sum(expect.values())
            rows.append((f"{mode} ({source})", axis, counted, f"{pred['fwd']} / {pred['bwd']} / {pred['sync']}",
                         f"{expect['fwd']} / {expect['bwd']} / {expect['sync']}", "yes" if same else "no",
                         NOTES.get((mode, axis), "")))
    return rows


def main():
    rows = table_rows()
    print("Bytes per Llama layer per rank and step (float64, 8 x 16 tokens, dim 32, FFN 64); counted = the "
          "runtime's collective counter (all directions); predicted/paper: forward / backward / gradient sync")
    print("| " + " | ".join(HEAD) + " |")
    print("|" + "---|" * len(HEAD))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    matched = sum(r[5] == "yes" for r in rows)
    print(f"{matched} of {len(rows)} axes match the papers (predicted and counted)")
    return matched == len(rows)


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
