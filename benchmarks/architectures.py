"""16. Every transformers family with a trainable head: build, export, verify on dp=2, verify on (2, 2) dp,tp under
0.6 of the unbudgeted plan's memory, plan on an unnamed (2, 2, 2) (issue 33).

Each family (autoshard/zoo/architectures.py: tiny config from its own config class, random weights, a synthetic
batch, its own loss) runs in a subprocess of its own with a timeout, so a hang or a crash costs one row. Cells:

- build:   the tiny model and a batch on which its forward returns a loss;
- export:  autoshard's trace (torch.export) of the model and its loss;
- dp2:     `verify` in the simulator on mesh (2,) named dp, every input's batch dim on dp, one SGD step;
- dp_tp:   `verify` on (2, 2) dp,tp, automatic plan (no hints) under 0.6 x the memory per rank of the same
           plan made without a budget, so the planner has to shard (or climb ZeRO / recomputation);
- plan222: `plan` on an unnamed (2, 2, 2): the planner picks each axis's role (pipelining included).

verify compares in float64; a model with an op that has no float64 kernel is compared in float32 with the
tolerance derived from its own rounding noise (the `dtype` column).

Results go to benchmarks/architectures.json as they come (one family at a time; a rerun skips the families
already there). Options (command line of `python -m benchmarks.architectures`, or environment variables for
`python -m benchmarks --only architectures`):

  --families a,b / AUTOSHARD_ARCH_FAMILIES   only these families
  --limit N      / AUTOSHARD_ARCH_LIMIT      at most N families not yet done
  --redo         / AUTOSHARD_ARCH_REDO=1     run families already in the JSON again
  --jobs N       / AUTOSHARD_ARCH_JOBS       families at once (one thread each)
  --timeout S    / AUTOSHARD_ARCH_TIMEOUT    seconds per family (default 600)
  --report                                   only rewrite the table from the JSON
  --quick        (python -m benchmarks --quick) a fixed sample of QUICK families
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import copy
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
JSON = HERE / "architectures.json"
CELLS = ("build", "export", "dp2", "dp_tp", "plan222")
QUICK = ("llama", "bert", "vit", "t5", "wav2vec2", "clip")
BUDGET_SHARE = 0.6
TIMEOUT = 600
MAX_RSS = 6 * 2**30  # a worker past this much memory is stopped (two run at once on a 23 GiB machine)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}"[:400]


def _report_error(report) -> str | None:
    """None for an OK verify report, else its worst mismatch in one line."""
    if report.ok:
        return None
    bad = [k for k, v in report.max_diff.items() if v > report.tolerances.get(k, report.tolerance)]
    k = bad[0]
    return (f"mismatch: {k} max rel diff {report.max_diff[k]:.2e} > {report.tolerances.get(k, report.tolerance):.1e} "
            f"({report.worst.get(k, '')})")


def run_family(family: str, cells=CELLS) -> dict:
    """Every cell of one family, in this process: {'family', 'head', 'model', 'dtype', 'cells': {cell:
    {'ok', 'error', 'seconds'}}}; a cell after a failed build or export is skipped."""
    import torch

    from autoshard.api import parallelize
    from autoshard.frontend.trace import trace
    from autoshard.ir.errors import UserInputError
    from autoshard.verify.tolerance import to_dtype
    from autoshard.verify.verify import verify_simulated
    from autoshard.zoo import architectures

    record = {"family": family, "head": architectures.families()[family], "model": None, "dtype": None,
              "cells": {}, "notes": {}}
    state = {}

    def cell(name, fn):
        if name not in cells:
            return
        began = time.perf_counter()
        try:
            error = fn()
        except Exception as exc:  # noqa: BLE001 (the cell's result: the error's first line)
            error = _first_line(exc)
            record["notes"].setdefault("tracebacks", {})[name] = traceback.format_exc()[-3000:]
        record["cells"][name] = {"ok": error is None, "error": error, "seconds": round(time.perf_counter() - began, 2)}

    def build():
        state["case"] = architectures.build(family)
        model = state["case"][0]
        record["model"] = type(model).__name__
        record["notes"]["parameters"] = sum(p.numel() for p in model.parameters())

    def export():
        model, inputs, loss_fn = state["case"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trace(model, inputs, loss_fn)
        custom = [str(w.message) for w in caught if "torch.autograd.Function" in str(w.message)]
        if custom:  # its own backward is not what autoshard differentiates: verify will differ (see FAILURES)
            record["notes"]["custom_backward"] = custom[0].splitlines()[0]

    def verify(options):
        """verify_simulated with `options(dtype)`, in float64 or, where the model cannot run in it, float32."""
        model, inputs, loss_fn = state["case"]
        for dtype in ([record["dtype"]] if record["dtype"] else ["float64", "float32"]):
            try:
                return dtype, verify_simulated(copy.deepcopy(model), inputs, loss_fn, dtype=dtype, steps=1,
                                               **options(dtype))
            except UserInputError as exc:
                if dtype == "float64" and "cannot run in float64" in str(exc):
                    continue
                raise
        raise RuntimeError("no dtype to verify in")

    def dp2():
        hints = {f"input:{i}": {"dp": "S(0)"} for i in range(len(state["case"][1]))}
        record["dtype"], (report, _) = verify(lambda dtype: {"mesh": (2,), "axis_names": ("dp",), "hints": hints})
        return _report_error(report)

    def dp_tp():
        model, inputs, loss_fn = state["case"]

        def options(dtype):
            low, low_inputs = to_dtype(model, inputs, getattr(torch, dtype))
            free = parallelize(low, (2, 2), low_inputs, loss_fn=loss_fn, axis_names=("dp", "tp"),
                               memory_budget=float("inf"))
            unbudgeted = free.plan.predicted["memory_bytes_per_rank"]
            record["notes"]["dp_tp_memory_unbudgeted"] = unbudgeted
            return {"mesh": (2, 2), "axis_names": ("dp", "tp"), "memory_budget": BUDGET_SHARE * unbudgeted}

        record["dtype"], (report, program) = verify(options)
        record["notes"]["dp_tp_memory_planned"] = program.plan.predicted["memory_bytes_per_rank"]
        record["notes"]["dp_tp_collectives"] = len(program.plan.collectives())
        return _report_error(report)

    def plan222():
        model, inputs, loss_fn = state["case"]
        parallelize(model, (2, 2, 2), inputs, loss_fn=loss_fn)

    cell("build", build)
    if "case" not in state:
        return record
    cell("export", export)
    if not record["cells"].get("export", {"ok": True})["ok"]:
        return record
    cell("dp2", dp2)
    cell("dp_tp", dp_tp)
    cell("plan222", plan222)
    return record


def _worker(family: str, out: str) -> None:
    """`python -m benchmarks.architectures --worker FAMILY --out FILE`: one family's record as JSON."""
    warnings.filterwarnings("ignore")  # tiny random models warn about their own configs; the table says what failed
    record = run_family(family)
    Path(out).write_text(json.dumps(record))


def run_in_subprocess(family: str, timeout: float = TIMEOUT, threads: int | None = None) -> dict:
    """One family's record from a subprocess; a timeout or a crash is a record too (its last log lines kept)."""
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autoshard-arch-") as tmp:
        out, log = os.path.join(tmp, "record.json"), os.path.join(tmp, "log.txt")
        env = dict(os.environ, PYTHONWARNINGS="ignore", TRANSFORMERS_VERBOSITY="error")
        if threads:
            env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        with open(log, "w") as handle:
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.architectures", "--worker", family, "--out",
                                     out], cwd=HERE.parent, env=env, stdout=handle, stderr=handle)
            failure = _watch(proc, timeout)
        if failure is None and os.path.exists(out):
            record = json.loads(Path(out).read_text())
        else:
            tail = Path(log).read_text()[-2000:]
            record = {"family": family, "head": _head(family), "model": None, "dtype": None,
                      "cells": {}, "notes": {"failure": failure, "log_tail": tail}}
            last = [line for line in tail.splitlines() if line.strip()]
            record["notes"]["crash"] = f"{failure}; {last[-1][:300] if last else ''}"
    record["seconds"] = round(time.perf_counter() - began, 1)
    return record


def _watch(proc, timeout: float) -> str | None:
    """Wait for the worker; stop it past `timeout` seconds or MAX_RSS bytes of memory. None: it exited 0. The time
    counted is the time this watcher ran: a sweep paused with SIGSTOP (for a timing run beside it) does not time its
    family out."""
    elapsed, last = 0.0, time.perf_counter()
    while proc.poll() is None:
        time.sleep(1)
        now = time.perf_counter()
        elapsed, last = elapsed + min(now - last, 5.0), now  # a longer gap: the sweep was paused
        reason = None
        if elapsed > timeout:
            reason = f"timeout: more than {timeout:.0f} s for the family"
        elif _rss(proc.pid) > MAX_RSS:
            reason = f"out of memory: more than {MAX_RSS / 2**30:.0f} GiB resident"
        if reason:
            proc.kill()
            proc.wait()
            return reason
    return None if proc.returncode == 0 else f"worker exited with code {proc.returncode}"


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            line = next(x for x in status if x.startswith("VmRSS:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return 0


def _head(family: str) -> str:
    from autoshard.zoo import architectures
    return architectures.families()[family]


def load_results() -> dict:
    """benchmarks/architectures.json: {'transformers': the last run's version, 'families': {family: record (with the
    transformers version it ran under)}}."""
    if JSON.exists():
        return json.loads(JSON.read_text())
    return {"transformers": None, "families": {}}


def save_results(results: dict) -> None:
    tmp = JSON.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    tmp.replace(JSON)


def status(record: dict, cell: str) -> str:
    """'ok', 'skipped' (an earlier cell failed), or the cell's error (a crash or timeout names itself)."""
    cells = record.get("cells", {})
    if cell in cells:
        return "ok" if cells[cell]["ok"] else cells[cell]["error"]
    if record.get("notes", {}).get("crash"):
        done = [c for c in CELLS if c in cells]
        return record["notes"]["crash"] if cell == CELLS[len(done)] else "skipped"
    return "skipped"


def sweep(names, jobs: int = 1, timeout: float = TIMEOUT, redo: bool = False, limit: int | None = None) -> dict:
    """Run the families `names` not yet in the JSON (all of them with `redo`), `jobs` at a time; the JSON is
    written after each."""
    import transformers
    results = load_results()
    results["transformers"] = transformers.__version__
    todo = [n for n in names if redo or n not in results["families"]]
    random.Random(33).shuffle(todo)  # a sweep stopped early has run a fair sample of the families, not the a's
    if limit is not None:
        todo = todo[:limit]
    print(f"[architectures] {len(todo)} families to run ({len(results['families'])} in {JSON.name}), "
          f"{jobs} at a time, timeout {timeout:.0f} s each", flush=True)
    threads = 1 if jobs > 1 else None
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_in_subprocess, name, timeout, threads): name for name in todo}
        for i, future in enumerate(concurrent.futures.as_completed(futures), 1):
            record = dict(future.result(), transformers=transformers.__version__)
            results["families"][record["family"]] = record
            save_results(results)
            cells = " ".join(f"{c}={'ok' if status(record, c) == 'ok' else 'FAIL'}" for c in CELLS)
            print(f"[architectures] {i}/{len(todo)} {record['family']} ({record['head']}): {cells} "
                  f"{record['seconds']:.0f} s", flush=True)
    return results


def summary(results: dict, names) -> tuple[str, list, list]:
    """(the text above the table, headers, rows) of the families `names`."""
    families = results["families"]
    done = [n for n in names if n in families]
    headers = ["family", "head", "model", "dtype", *CELLS, "seconds"]
    rows = []
    for name in done:
        record = families[name]
        rows.append([name, record["head"], record.get("model") or "", record.get("dtype") or "",
                     *(_cell_text(record, c) for c in CELLS), f"{record.get('seconds', 0):.0f}"])
    passed = {c: sum(status(families[n], c) == "ok" for n in done) for c in CELLS}
    exportable = [n for n in done if status(families[n], "export") == "ok"]
    all_ok = [n for n in exportable if all(status(families[n], c) == "ok" for c in CELLS)]
    share = f"{100 * len(all_ok) / len(exportable):.0f}%" if exportable else "n/a"
    versions = collections.Counter(families[n].get("transformers", "?") for n in done)  # a rerun may mix releases
    run_under = ", ".join(f"{v} ({k} families)" if len(versions) > 1 else v for v, k in sorted(versions.items()))
    text = [(f"transformers {run_under}: {len(names)} families with a trainable head; "
            f"**{len(done)} of {len(names)} run**" +
             (" (the rest not yet: the sweep resumes where it stopped)." if len(done) < len(names) else ".")),
            "",
            "Passing each cell (of the families run): " + ", ".join(f"{c} {passed[c]}" for c in CELLS) + ".",
            f"Of the {len(exportable)} families torch.export traced, **{len(all_ok)} ({share}) pass every cell**.",
            "",
            ("Cells: build (tiny config from the family's config class, synthetic batch, its own loss), export "
            "(autoshard's torch.export trace), dp2 (verify in the simulator on mesh (2,) dp, one SGD step), dp_tp "
            f"(verify on (2, 2) dp,tp, automatic plan under {BUDGET_SHARE} x the unbudgeted plan's memory per rank), "
            "plan222 (plan on an unnamed (2, 2, 2)). dtype: what verify compared in (float32 where the model has "
            "no float64 kernel, tolerance from its own noise). Failures and what to do: docs/error_catalogue.md, "
            "section \"Architectures sweep\". Reproduce: `python -m benchmarks --only architectures` "
            "(options: `python -m benchmarks.architectures --help`); per-family details in "
            "benchmarks/architectures.json."),
            ""]
    return "\n".join(text), headers, rows


def _cell_text(record: dict, cell: str) -> str:
    text = status(record, cell)
    if text in ("ok", "skipped"):
        seconds = record.get("cells", {}).get(cell, {}).get("seconds")
        return f"ok ({seconds:.0f} s)" if text == "ok" and seconds is not None else ("—" if text == "skipped" else text)
    return text.replace("|", "\\|").replace("\n", " ")[:160]


def write_report(names) -> None:
    from benchmarks.report import table, write_section
    results = load_results()
    body, headers, rows = summary(results, names)
    write_section("architectures", "16. Every transformers architecture: export, verify dp=2, verify (2,2) under a "
                  "memory budget, plan (2,2,2)", body + "\n" + table(headers, rows), headers, rows)


# Failure classes of the sweep: (name, cells, pattern of the error, cause, what the user can do). A family's class is
# that of its first failing cell; docs/error_catalogue.md's section "Architectures sweep" is written from these.
FAILURES = [
    ("build: the generic size rules do not fit the config", ("build",),
     r"BuildError|parameters after shrinking|ValidationError|ValueError",
     ("the family's config ties sizes together in a way the field-name rules (autoshard/zoo/architectures.py) do "
     "not know (e.g. a width that must equal expand x heads x head_dim), or its forward needs inputs the synthetic "
     "batch does not give"), ("build the model from a config of your own (any consistent small sizes) and pass it "
     "to parallelize / a factory; nothing in autoshard is involved yet")),
    ("export: data-dependent control flow", ("export",), r"data-dependent|GuardOnDataDependent",
     ("the forward branches on tensor values or makes a shape from them (a loop over the experts that received "
     "tokens, `nonzero`, `.item()`); torch.export cannot trace that"),
     ("the ExportError names the line: use torch.where / torch.cond, or the family's static variant (MoE: "
     "`experts_implementation=\"grouped_mm\"` or `\"batched_mm\"`)")),
    ("export: a cache or non-tensor output", ("export",), r"DynamicCache|Cache|not a known type",
     "the model returns a cache object (use_cache on a sub-config)", ("build with `use_cache=False` on every "
     "(sub-)config")),
    ("export: other", ("export",), r".", "torch.export could not trace the model (the message says why)",
     "check that `torch.export.export(model, inputs, strict=False)` works on its own; the ExportError names the line"),
    ("planning: data-dependent sizes in the graph", ("dp2", "dp_tp", "plan222"), r"GuardOnDataDependent",
     ("the graph exports but holds sizes known only at run time (unbacked SymInts, e.g. the tokens routed to each "
     "expert); autoshard's strategies and cost model need static shapes (autoshard/strategies/base.py `_divides`, "
     "autoshard/strategies/views.py)"), ("use a static-shape variant of the layer (capacity-based experts, as "
     "autoshard.zoo.moe); planning over unbacked sizes is an open gap")),
    ("verify: the model's own backward", ("dp2", "dp_tp"), r"^custom backward: mismatch",
     ("the model applies a torch.autograd.Function whose backward is not its forward's derivative (YOSO's is an "
     "approximation); torch.export traces the forward and autoshard differentiates it, so the gradients differ from "
     "the model's own (autoshard warns when it traces such a model)"), ("expected: the parallel program is exact for "
     "the forward; to train with the approximation, express it in the forward (e.g. `x + (approx - x).detach()`)")),
    ("verify: results differ", ("dp2", "dp_tp"), r"^mismatch", ("the parallel program's loss, gradients or "
     "parameters differ from the single device's beyond the tolerance"), ("report it with the family's factory "
     "(`autoshard.zoo.architectures:<family>`): this is an autoshard bug")),
    ("planning: memory budget", ("dp_tp", "plan222"), r"MemoryBudget|memory budget", ("no plan fits 0.6 x the "
     "unbudgeted plan's memory"), "raise the budget or add devices"),
    ("planning: the ILP's time limit", ("dp2", "dp_tp", "plan222"), r"IlpTimeLimitError", ("under the memory budget "
     "the sharding ILP found no plan within its time limit (scaled to its size; on a loaded machine HiGHS gets less "
     "of it)"), ("raise `ilp_time_limit=` (`--ilp-time-limit`), or loosen the budget, or give ZeRO / `checkpoint=` "
     "instead of having them searched (the message lists these)")),
    ("planning: too slow", ("timeout",), r"timeout", ("planning under the budget took longer than the sweep's "
     "timeout per family"), "raise `--timeout`; pass `ilp_time_limit=` to bound each sharding ILP"),
    ("worker out of memory", ("crash",), r"out of memory", ("the tiny model still used more than the worker's "
     "memory limit"), "shrink the config further"),
    ("verify: the model cannot be copied", ("dp2", "dp_tp"), r"deepcopy protocol",
     ("verify trains a copy of the model (copy.deepcopy) and the model keeps a tensor computed from its parameters "
      "as a plain attribute (not a leaf: RecurrentGemma's), which torch cannot copy"),
     ("compare the parallel program with a single-device run of your own model (prog.module / run_ranks), or keep "
      "such a tensor as a non-persistent buffer computed without gradients")),
    ("config: per-layer attributes", ("build",), (r"AmbiguousGlobalPerLayerAttribute|explicit intermediate size "
     r"for every layer"), ("the family's config gives some sizes per layer (head_dim, sliding_window, intermediate_size "
     "per layer); the generic size rules shrink one global value"), ("build the model from a config of your own "
     "with consistent per-layer sizes; nothing in autoshard is involved yet")),
    ("other", CELLS + ("crash", "timeout"), r".", "see the error's first line", "see the message"),
]


def failure_class(record: dict):
    """(class name, cell, error) of a family's first failing cell, or None when every cell passed.

    >>> failure_class({"cells": {"build": {"ok": True}, "export": {"ok": False, "error": "ExportError: ... "
    ...                "GuardOnDataDependentSymNode: Could not guard"}}})[0]
    'export: data-dependent control flow'
    """
    import re
    for cell in CELLS:
        text = status(record, cell)
        if text in ("ok", "skipped"):
            continue
        kind = "timeout" if text.startswith("timeout") else "crash" if text.startswith(("out of memory", "worker")) \
            else cell
        if text.startswith("mismatch") and record.get("notes", {}).get("custom_backward"):
            text = f"custom backward: {text}"
        for name, cells, pattern, _, _ in FAILURES:
            if kind in cells and re.search(pattern, text):
                return name, cell, text
    return None


CATALOGUE = HERE.parent / "docs" / "error_catalogue.md"


def write_catalogue(results: dict, names) -> None:
    """docs/error_catalogue.md's section "Architectures sweep": each failure class with its families."""
    families = results["families"]
    found = {}
    for name in names:
        if name in families and (hit := failure_class(families[name])) is not None:
            found.setdefault(hit[0], []).append((name, hit[1], hit[2]))
    lines = ["<!-- architectures -->", "## Architectures sweep (benchmarks/architectures.py)", "",
             ("Written by `python -m benchmarks.architectures --report` from benchmarks/architectures.json: every "
             "family of the sweep that fails a cell, by the class of its first failing cell (the table in "
             "benchmarks/RESULTS.md, section 16, has every cell)."), "",
             "| class | families | cause | what to do |", "|---|---|---|---|"]
    for name, _, _, cause, todo in FAILURES:
        if name in found:
            fams = ", ".join(f"{f} ({cell}: {err[:90].replace('|', '/')})" for f, cell, err in found[name])
            lines.append(f"| {name} ({len(found[name])}) | {fams} | {cause} | {todo} |")
    lines.append("<!-- /architectures -->")
    section = "\n".join(lines) + "\n"
    text = CATALOGUE.read_text()
    start, end = text.find("<!-- architectures -->"), text.find("<!-- /architectures -->")
    if start >= 0 and end >= 0:
        text = text[:start] + section + text[end + len("<!-- /architectures -->\n"):]
    else:
        gaps = text.find("## Known gaps")
        text = text[:gaps] + section + "\n" + text[gaps:] if gaps >= 0 else text.rstrip("\n") + "\n\n" + section
    CATALOGUE.write_text(text)


def selected(families_arg=None, quick: bool = False) -> list[str]:
    from autoshard.zoo import architectures
    names = list(architectures.families())
    if families_arg:
        wanted = [n for n in families_arg.split(",") if n]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise SystemExit(f"unknown families {unknown}; see autoshard.zoo.architectures.families()")
        return wanted
    return list(QUICK) if quick else names


def main(quick: bool = False, argv=None) -> None:
    env = os.environ
    parser = argparse.ArgumentParser(prog="python -m benchmarks.architectures", description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=env.get("AUTOSHARD_ARCH_FAMILIES"))
    parser.add_argument("--limit", type=int, default=int(env["AUTOSHARD_ARCH_LIMIT"]) if env.get(
        "AUTOSHARD_ARCH_LIMIT") else None)
    parser.add_argument("--redo", action="store_true", default=env.get("AUTOSHARD_ARCH_REDO") == "1")
    parser.add_argument("--jobs", type=int, default=int(env.get("AUTOSHARD_ARCH_JOBS", "1")))
    parser.add_argument("--timeout", type=float, default=float(env.get("AUTOSHARD_ARCH_TIMEOUT", TIMEOUT)))
    parser.add_argument("--report", action="store_true", help="only rewrite the table from the JSON")
    parser.add_argument("--quick", action="store_true", default=quick)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args([] if argv is None and __name__ != "__main__" else argv)
    if args.worker:
        _worker(args.worker, args.out)
        return
    names = selected(args.families, args.quick)
    if not args.report:
        sweep(names, jobs=args.jobs, timeout=args.timeout, redo=args.redo, limit=args.limit)
    write_report(selected())
    write_catalogue(load_results(), selected())


if __name__ == "__main__":
    main(argv=sys.argv[1:])
