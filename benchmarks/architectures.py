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
        trace(model, inputs, loss_fn)

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
    import warnings
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
    """Wait for the worker; stop it past `timeout` seconds or MAX_RSS bytes of memory. None: it exited 0."""
    began = time.perf_counter()
    while proc.poll() is None:
        time.sleep(1)
        reason = None
        if time.perf_counter() - began > timeout:
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
    """benchmarks/architectures.json: {'transformers': version, 'families': {family: record}}."""
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
            record = future.result()
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
    text = [(f"transformers {results.get('transformers')}: {len(names)} families with a trainable head; "
            f"**{len(done)} of {len(names)} run** (the rest not yet: the sweep resumes where it stopped)."),
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


if __name__ == "__main__":
    main(argv=sys.argv[1:])
