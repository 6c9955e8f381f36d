"""Benchmark 18, predictions a user can trust: after `calibrate` on this machine, each plan's predicted step (and
its phases, bytes per axis) against the same plan trained on real gloo ranks, and whether the planner's ranking of
the plans is the measured one.

For 1, 2 and 4 ranks and each model: `calibrated_profile` measures the links and compute rates with that many ranks
running at once (the contention training meets on this machine), then the model is planned under that profile with
each plan (data parallel, Megatron tensor parallel for the zoo models, ZeRO-3, a 2-stage pipeline, and the planner's own
automatic plan on the unnamed mesh) and trained: SGD, gradient sync after backward (overlap off: the predicted step
is not overlapped), in `ROUNDS` rounds that take the plans in turn: in each, `WARMUP` steps and then at least `STEPS`
measured back to back (as many as make `ROUND_S` seconds), the slowest rank's mean step (its loop's time per step: the
job's throughput) the round's figure, each phase its mean; the median round is the plan's measured figure and the
rounds' spread is published beside it. After a model's runs the machine is calibrated again (that calibration is the
next model's), each plan is priced anew under it (the same plan file: its decisions and cut applied, not re-planned),
and the plan's predicted figures are the mean of its prices under the calibrations just before and just after its
runs: this VM's speed moves 20-30% from one minute to the next, and one calibration is one minute's.
Targets (issue 32): step within 20% (median error within 10%), and the measured fastest plan is the planner's choice
or within 5% of it.

    python -m benchmarks --only prediction_accuracy
"""
from __future__ import annotations

import math
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import autoshard
from autoshard.cost.calibrate import calibrated_profile
from autoshard.cost.profiles import HardwareProfile
from autoshard.ir.mesh import Mesh
from autoshard.report.accuracy import StepClock, axis_bytes, log_bytes, predicted_phases
from autoshard.runtime.launch import communicator_for, run_distributed
from autoshard.runtime.zero import ZeroOptimizer
from autoshard.zoo import gpt2, llama, transformers_families
from autoshard.zoo.hints import plan_hints

from .report import table, write_section

WORLDS = (1, 2, 4)
WARMUP, STEPS = 2, 10
# Each plan is measured in ROUNDS rounds, the plans in turn, and the median round is its figure: one run of a plan on
# this VM moves by 20-50% from one minute to the next (the transformers Qwen2 on 2 ranks, the same plan and profile
# twice: data parallel 6.35 and 4.30 ms, ZeRO-3 34.1 and 45.1 ms), more than the 20% the predictions are held to.
# The rounds' spread is published beside each figure: what the run itself varies by. Five rounds: the median then
# stands while two of them are disturbed (three let one).
ROUNDS = 5
# A round lasts at least this long: ten steps of the transformers models' 2-8 ms are 20-80 ms, which one descheduling
# of a rank moves by half (their rounds spread 25-68% in the 1b1e358 run).
ROUND_S = 0.5
# The calibrations time float32's matmuls only: every plan here trains in float32.
DTYPES = ("float32",)
# The deadline of one rank count's training task (every plan's rounds: minutes on 4 ranks sharing 2 cores; a slow hour
# overran run_distributed's default 180 s); each collective keeps its own timeout.
TASK_S = 1800
# The transformers families at the zoo models' size (hidden 256, 4 layers, 8 heads, vocabulary 512, batch 8 x 64
# tokens), not at the test suite's (hidden 32, 2 layers, batch 4 x 8): their 2-40 ms steps there are mostly per-op
# dispatch, which moves with this VM's state more than the targets allow (all 13 misses of the run at 58134a3).
_ZOO_SIZE = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 128}
_TOKENS = (8, 64)
MODELS = {
    "gpt2 (zoo)": lambda: gpt2(batch=8, seq=64, dim=256, n_heads=8, n_layers=4, vocab_size=512),
    "llama (zoo)": lambda: llama(batch=8, seq=64, dim=256, n_heads=8, n_kv_heads=4, ffn_dim=512, n_layers=4,
                                 vocab_size=512),
    "transformers GPT-2": lambda: transformers_families.causal_lm(
        "GPT2LMHeadModel", "GPT2Config", tokens=_TOKENS, vocab_size=512, n_embd=256, n_layer=4, n_head=8, n_inner=1024,
        n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2),
    "transformers Llama": lambda: transformers_families.causal_lm(
        "LlamaForCausalLM", "LlamaConfig", tokens=_TOKENS, **{**transformers_families.DECODER, **_ZOO_SIZE}),
    "transformers Qwen2": lambda: transformers_families.causal_lm(
        "Qwen2ForCausalLM", "Qwen2Config", tokens=_TOKENS, **{**transformers_families.DECODER, **_ZOO_SIZE}),
}
ZOO_NAMES = {"gpt2 (zoo)": "gpt2", "llama (zoo)": "llama"}
QUICK_MODELS = ("gpt2 (zoo)",)
SGD = {"optimizer_state_factor": 0.0}  # the runs step plain SGD: no optimizer state


def plans_for(name: str, world: int) -> dict:
    """{plan name: (axis names, parallelize options)} compared for `name` on `world` ranks."""
    if world == 1:
        return {"single device": (("dp",), {})}
    batch = {"input:0": {"dp": "S(0)"}}
    if name not in ZOO_NAMES:  # labels split with the ids
        batch["input:1"] = {"dp": "S(0)"}
    out = {"data parallel": (("dp",), {"hints": batch}),
           "ZeRO-3": (("dp",), {"hints": batch, "zero": 3})}
    if name in ZOO_NAMES:
        out["Megatron TP"] = (("tp",), {"hints": plan_hints(ZOO_NAMES[name], ("tp",), (), "tp")})
    batch_size = MODELS[name]()[1][0].shape[0]
    micro = next(m for m in (2 * world, world, 1) if batch_size % m == 0)  # a batch too small for 2 per rank: fewer
    out[f"pipeline ({world} stages, 1F1B, {micro} micro-batches)"] = (
        ("pp",), {"pipeline": {"schedule": "1f1b", "microbatches": micro}})
    out["automatic"] = (None, {})
    return out


def plan_case(name: str, world: int, plan_name: str, axes, options: dict, profile, folder: str) -> dict:
    """Plan one case under `profile` and save it; its predictions."""
    model, inputs, loss_fn = MODELS[name]()
    started = time.perf_counter()
    options = {"pipeline": None if axes is None else False, **SGD, **options}  # pipelines only where asked or chosen
    prog = autoshard.parallelize(model, (world,), inputs, loss_fn=loss_fn, axis_names=axes, profile=profile,
                                 **options)
    path = os.path.join(folder, f"plan-{len(os.listdir(folder))}.json")
    prog.plan.save(path)
    return {"model": name, "world": world, "plan": plan_name, "path": path,
            "axes": list(prog.mesh.names) if prog.mesh.named else None,
            "profile": profile.to_json(),
            "zero": (options.get("zero") is not None) or prog.zero is not None,
            "predicted": predicted_phases(prog), "bytes": axis_bytes(prog),
            "pipelined": bool(prog.plan.pipeline), "planning_s": time.perf_counter() - started,
            "roles": prog.plan.axis_roles()}


def _train_task(rank, world, jobs):
    """Every job on this rank, measured in `ROUNDS` interleaved rounds (each job's steps once per round, the jobs in
    turn): per job, each round's StepClock phases (and bytes) over its measured steps."""
    torch.manual_seed(0)
    prepared = [prepared_step(job, rank) for job in jobs]
    steps = [_steps_per_round(make_step) for make_step, _ in prepared]
    out = [[] for _ in jobs]
    for _ in range(ROUNDS):
        for runs, (make_step, comm), count in zip(out, prepared, steps):
            clock = StepClock(warmup=WARMUP, bytes_now=lambda comm=comm: log_bytes(comm))
            step = make_step(clock)
            # Steps back to back, as a training loop runs them (the ranks keep pace through their collectives): a
            # barrier before each step put a gloo all-reduce's latency (0.3-1 ms here) in every measured step,
            # which the plan's step does not have (the 3-8 ms steps of the transformers models read it as their
            # optimizer's).
            dist.barrier()
            for _ in range(WARMUP + count):
                step()
            clock.mark("forward")  # ends the last step
            dist.barrier()
            runs.append(clock.phases("mean"))  # the loop's time per step (`StepClock.phases`)
    return out


def _steps_per_round(make_step) -> int:
    """How many steps make a round of at least ROUND_S (and at least STEPS), from WARMUP steps timed now; the same on
    every rank (the slowest rank's count: the steps pair the ranks' collectives)."""
    step = make_step(StepClock(warmup=WARMUP))
    dist.barrier()
    started = time.perf_counter()
    for _ in range(WARMUP):
        step()
    per_step = (time.perf_counter() - started) / WARMUP
    count = torch.tensor([max(STEPS, math.ceil(ROUND_S / max(per_step, 1e-6)))], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def prepared_step(job, rank):
    """(clock -> one training step of `job`'s plan on this rank, its communicator)."""
    prog, inputs = _applied(job, HardwareProfile.from_json(job["profile"]))
    comm = communicator_for(prog.mesh)
    module = prog.module(rank, comm)
    params = [p for _, p in module.named_local_parameters()]
    # a pipeline rank may hold no parameters (a stage of parameter-free ops): nothing to step
    opt = torch.optim.SGD(params, lr=1e-3) if params else _NoOptimizer()
    if prog.zero is not None:
        opt = ZeroOptimizer(module, opt)
    if getattr(module, "pipelined", False):
        return (lambda clock: _pipeline_step(module, opt, inputs, clock)), comm
    module.overlap = False
    local = module.local_inputs(*inputs)
    return (lambda clock: _flat_step(module, opt, local, clock)), comm


class _NoOptimizer:
    def step(self):
        pass

    def zero_grad(self, set_to_none: bool = True):
        pass


def _flat_step(module, opt, local, clock):
    def step():
        clock.mark("forward")
        loss, _ = module(*local)
        clock.mark("forward_end")
        loss.backward()
        clock.mark("sync")
        module.sync_grads()
        clock.mark("sync_end")
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def _pipeline_step(module, opt, inputs, clock):
    def step():
        clock.mark("forward")
        module.train_step(*inputs, sync=False)
        clock.mark("forward_end")
        clock.mark("sync")
        module.sync_step(1)
        clock.mark("sync_end")
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def measure(quick: bool = False) -> list[dict]:
    """For each rank count and model: calibrate, plan its cases under that profile and train them, calibrate again
    and price the same plans under it; one row per case, its predictions the mean of the two prices. Calibrated
    around each model's runs (not once per rank count): this VM's speed moves 20-30% over the few minutes one rank
    count's runs take, so the runs stay within a minute or two of the figures they are predicted with."""
    rows = []
    models = QUICK_MODELS if quick else tuple(MODELS)
    with tempfile.TemporaryDirectory() as folder:
        for world in WORLDS[:2] if quick else WORLDS:
            after = calibrated_profile(Mesh((world,), ("dp",)), dtypes=DTYPES, quiet=True)
            for name in models:
                profile = after  # the calibration just before this model's runs
                jobs = []
                for plan_name, (axes, options) in plans_for(name, world).items():
                    try:
                        jobs.append(plan_case(name, world, plan_name, axes, options, profile, folder))
                    except autoshard.AutoshardError as exc:
                        rows.append({"model": name, "world": world, "plan": plan_name,
                                     "error": str(exc).splitlines()[0]})
                measured = run_distributed(_train_task, world, jobs, total_s=TASK_S)
                after = calibrated_profile(Mesh((world,), ("dp",)), dtypes=DTYPES, quiet=True)
                for job in jobs:
                    job["predicted_before"], job["predicted_after"] = job["predicted"], repriced(job, after)
                    job["predicted"] = {key: (value + job["predicted_after"][key]) / 2
                                        for key, value in job["predicted_before"].items()}
                for i, job in enumerate(jobs):
                    rounds = [max((got[i][r] for got in measured.values()), key=lambda m: m["step_s"])
                              for r in range(ROUNDS)]  # each round's slowest rank
                    rows.append(dict(job, measured=median_round(rounds), rounds=[m["step_s"] for m in rounds],
                                     sent={axis: max(got[i][r]["bytes"].get(axis, 0) for got in measured.values()
                                                     for r in range(ROUNDS)) for axis in job["bytes"]}))
    return rows


def _applied(job, profile) -> tuple:
    """(`job`'s plan file applied under `profile`: its decisions and cut as made, priced anew; the example inputs)."""
    model, inputs, loss_fn = MODELS[job["model"]]()
    axes = tuple(job["axes"]) if job["axes"] else None  # None: the automatic plan's unnamed mesh
    prog = autoshard.parallelize(model, (job["world"],), inputs, loss_fn=loss_fn, axis_names=axes, plan=job["path"],
                                 profile=profile, **SGD)
    return prog, inputs


def repriced(job, profile) -> dict:
    """`job`'s plan (its file: decisions and cut as made) priced under `profile`: its predicted phases."""
    return predicted_phases(_applied(job, profile)[0])


def calibrations_apart(row) -> float:
    """How far the plan's prices under the calibrations before and after its runs are apart, over their mean.

    >>> calibrations_apart({"predicted_before": {"step_s": 1.0}, "predicted_after": {"step_s": 1.5},
    ...                     "predicted": {"step_s": 1.25}})
    0.4
    """
    return abs(row["predicted_after"]["step_s"] - row["predicted_before"]["step_s"]) / row["predicted"]["step_s"]


def median_round(rounds: list[dict]) -> dict:
    """The round of the median step (the lower middle one of an even count): its phases are the plan's figures.

    >>> median_round([{"step_s": 3.0}, {"step_s": 1.0}, {"step_s": 2.0}])
    {'step_s': 2.0}
    """
    return sorted(rounds, key=lambda m: m["step_s"])[(len(rounds) - 1) // 2]


def spread(row) -> float:
    """How far the plan's rounds are apart: (slowest - fastest) / the median round.

    >>> spread({"rounds": [1.0, 1.5, 1.25], "measured": {"step_s": 1.25}})
    0.4
    """
    return (max(row["rounds"]) - min(row["rounds"])) / row["measured"]["step_s"]


def _ratio(row, key="step_s"):
    measured = row["measured"][key]
    return row["predicted"][key] / measured if measured else None


def rankings(rows) -> list[dict]:
    """Per (model, world) with several plans: the planner's fastest predicted plan, the measured fastest, and how
    much slower (measured) the planner's choice is than the measured fastest."""
    out = []
    groups: dict = {}
    for row in rows:
        if "error" not in row:
            groups.setdefault((row["model"], row["world"]), []).append(row)
    for (model, world), group in groups.items():
        if len(group) < 2:
            continue
        chosen = next((r for r in group if r["plan"] == "automatic"), None) or \
            min(group, key=lambda r: r["predicted"]["step_s"])
        fastest = min(group, key=lambda r: r["measured"]["step_s"])
        by_prediction = sorted(group, key=lambda r: r["predicted"]["step_s"])
        by_measure = sorted(group, key=lambda r: r["measured"]["step_s"])
        out.append({"model": model, "world": world, "chosen": chosen["plan"], "fastest": fastest["plan"],
                    "slower": chosen["measured"]["step_s"] / fastest["measured"]["step_s"] - 1,
                    "same_order": [r["plan"] for r in by_prediction] == [r["plan"] for r in by_measure]})
    return out


def report(rows) -> tuple[str, list, list]:
    headers = ["model", "ranks", "plan", "predicted step ms", "measured step ms", "predicted/measured",
               "rounds' spread", "calibrations apart", "fwd", "bwd", "sync", "optimizer",
               "bytes/step predicted = measured"]
    out = []
    for row in rows:
        if "error" in row:
            out.append([row["model"], row["world"], row["plan"], "no plan: " + row["error"][:80], "", "", "", "", "",
                        "", "", "", ""])
            continue
        phases = ["-" if _ratio(row, k) is None else f"{_ratio(row, k):.2f}"
                  for k in ("forward_s", "backward_s", "sync_s", "optimizer_s")]
        same = all(row["bytes"][a] == row["sent"].get(a, 0) for a in row["bytes"])
        out.append([row["model"], row["world"], row["plan"], f"{row['predicted']['step_s'] * 1e3:.2f}",
                    f"{row['measured']['step_s'] * 1e3:.2f}", f"{_ratio(row):.2f}", f"{100 * spread(row):.0f}%",
                    f"{100 * calibrations_apart(row):.0f}%", *phases,
                    "yes" if same else f"no ({row['bytes']} vs {row['sent']})"])
    ratios = [_ratio(row) for row in rows if "error" not in row]
    errors = sorted(abs(r - 1) for r in ratios)
    within = sum(e <= 0.2 for e in errors)
    measured = [row for row in rows if "error" not in row]
    noisy = sum(spread(row) > 0.2 for row in measured)
    spreads = sorted(spread(row) for row in measured)
    inside = sum(min(row["rounds"]) <= row["predicted"]["step_s"] <= max(row["rounds"]) for row in measured)
    ranked = rankings(rows)
    rank_rows = [[r["model"], r["world"], r["chosen"], r["fastest"], f"{100 * r['slower']:.1f}%",
                  "yes" if r["slower"] <= 0.05 else "no", "yes" if r["same_order"] else "no"] for r in ranked]
    median = statistics.median(errors) if errors else math.nan
    body = (
        "Each plan's predicted step (the planner's step under the profile `calibrate` measured on this machine with "
        "as many ranks running, plus the optimizer's update; the mean of its prices under the calibrations just before "
        "and just after its model's runs, the plan made under the first: 'calibrations apart' is how far those two "
        "prices differ, over their mean) against the same plan trained on that many gloo ranks "
        f"(SGD, gradient sync after backward; in each of {ROUNDS} rounds, the plans in turn, {WARMUP} warm-up steps, then "
        f"the mean of at least {STEPS} steps run back to back, as many as last {ROUND_S:g} s: the loop's time per step, "
        "the slowest rank's; the measured figure "
        "is the median round, and the rounds' spread is (slowest - fastest) / median: what the run itself varies by). "
        "Phase columns: predicted / measured of forward, backward, gradient sync, optimizer (a pipeline's forward "
        "column holds its whole schedule).\n\n"
        + table(headers, out)
        + f"\n\n**Step time: {within} of {len(errors)} plans within 20% (target: all); median error "
        f"{100 * median:.1f}% (target: within 10%).** The run's own noise: the rounds of {noisy} of {len(measured)} "
        f"plans spread over more than 20% (median spread {100 * statistics.median(spreads) if spreads else math.nan:.0f}%); "
        f"{inside} predictions fall between their plan's fastest and slowest round.\n\n"
        "The planner's choice (the automatic plan) against the measured fastest plan of the same model and ranks "
        "(target: the fastest, or within 5% of it):\n\n"
        + table(["model", "ranks", "planner's choice", "measured fastest", "choice slower by", "within 5%",
                 "predicted order = measured order"], rank_rows)
        + "\n\nReproduce: `python -m benchmarks --only prediction_accuracy` (calibrates before and after each model's "
        "runs; about 25 minutes on 2 cores). Peak memory is compared term by term in section 15 (memory_accuracy).\n")
    csv_rows = [[row["model"], row["world"], row["plan"], row.get("error", ""),
                 row["predicted"]["step_s"] if "error" not in row else "",
                 row["measured"]["step_s"] if "error" not in row else ""] for row in rows]
    return body, ["model", "ranks", "plan", "error", "predicted_step_s", "measured_step_s"], csv_rows


def main(quick: bool = False) -> None:
    body, headers, rows = report(measure(quick))
    write_section("prediction_accuracy", "18. Predicted vs measured step time after calibrate (gloo ranks)", body,
                  headers, rows)
