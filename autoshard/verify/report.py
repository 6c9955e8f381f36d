"""What verify reports: the largest relative difference per kind (loss, outputs, gradients, parameters; fp16's
loss scale) between the parallel program and the single device, each against its tolerance (1e-6 in float64;
below it derived from the model's own noise, autoshard/verify/tolerance.py), and the collectives one step ran.

>>> import torch
>>> from autoshard.verify.verify import rank_run, reference_run, simulate_ranks, to_double, verify_simulated
>>> from autoshard.verify.training import VerifyOptions
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> hints = {"input:0": {"dp": "S(0)"}, "layers.0.weight": {"tp": "S(0)"}, "layers.0.bias": {"tp": "R"},
...          "layers.1.*": {"tp": "R"}}
>>> report, program = verify_simulated(model, inputs, loss_fn, mesh=(2, 2), axis_names=("dp", "tp"), hints=hints)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from autoshard.verify.tolerance import (
    FLOAT64_TOLERANCE,
    RULE,
    coarsest_dtype,
    dtype_name,
    tolerance_for,
)
from autoshard.verify.training import PLAIN, Training, VerifyOptions

TOLERANCE = FLOAT64_TOLERANCE  # relative, in float64; below it tolerances are derived per tensor


@dataclass
class VerifyReport:
    """Largest relative differences and the collectives one training step ran on rank 0. Per kind (loss,
    outputs, grads, params): the difference and name of the tensor nearest its tolerance, that tolerance
    and (below float64) the noise it came from.

    >>> print(report)  # doctest: +ELLIPSIS
    verify: OK (2 steps, float64, tolerance 1e-06)
      loss     max rel diff ...
    """

    max_diff: dict = field(default_factory=dict)
    worst: dict = field(default_factory=dict)
    collectives: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)
    steps: int = 0
    tolerance: float | None = TOLERANCE  # None: derived per tensor (`tolerances`)
    dtype: str = "float64"
    tolerances: dict = field(default_factory=dict)
    noise: dict = field(default_factory=dict)
    training: Training = PLAIN
    random_ops: int = 0  # dropout and other random ops the program draws (in `training.rng` mode)

    @property
    def ok(self) -> bool:
        """Every largest relative difference is within its tolerance.

        >>> report.ok, VerifyReport(max_diff={"loss": 1e-3}).ok
        (True, False)
        """
        return all(v <= self.tolerances.get(k, self.tolerance) for k, v in self.max_diff.items())

    def to_json(self) -> dict:
        """What `verify --json` prints.

        >>> sorted(report.to_json())  # doctest: +NORMALIZE_WHITESPACE
        ['collectives_per_step', 'dtype', 'max_rel_diff', 'noise', 'ok', 'predicted', 'random_ops', 'steps',
         'tolerance', 'tolerance_rule', 'tolerances', 'training', 'worst']
        """
        return {"ok": self.ok, "steps": self.steps, "dtype": self.dtype, "training": self.training.to_json(),
                "random_ops": self.random_ops,
                "tolerance": self.tolerance,
                "tolerance_rule": "relative 1e-6" if self.tolerance is not None else RULE,
                "tolerances": self.tolerances, "noise": self.noise, "max_rel_diff": self.max_diff,
                "worst": self.worst, "collectives_per_step": self.collectives, "predicted": self.predicted}

    def __repr__(self) -> str:
        bound = f"tolerance {self.tolerance:g}" if self.tolerance is not None else f"tolerance {RULE}"
        training = self.training
        features = "".join([f", {training.accumulate} passes per step" if training.accumulate > 1 else "",
                            f", clipped to norm {training.clip_grad_norm:g}" if training.clip_grad_norm is not None
                            else "", f", {self.random_ops} random ops drawn rng={training.rng} (seed {training.seed})"
                            if self.random_ops else "", f", {training.mixed_precision} mixed precision"
                            if training.mixed_precision else ""])
        lines = [f"verify: {'OK' if self.ok else 'MISMATCH'} ({self.steps} steps{features}, {self.dtype}, {bound})"]
        for key, value in self.max_diff.items():
            extra = "" if self.tolerance is not None else \
                f"; tolerance {self.tolerances[key]:.2e} from noise {self.noise[key]:.2e}"
            lines.append(f"  {key:<8} max rel diff {value:.3e}  ({self.worst.get(key, '')}{extra})")
        for axis, kinds in self.collectives.items():
            for kind, c in kinds.items():
                lines.append(f"  axis {axis}: {kind} fwd {c['fwd']} bwd {c['bwd']} sync {c.get('sync', 0)} "
                             f"bytes {c['bytes']}")
        return "\n".join(lines)


ABS_FLOOR = 1e-9  # gradients that are zero in exact arithmetic (e.g. a key bias) compare absolutely
# ... and so do those below this share of the model's largest gradient: a BatchNorm's bias followed by another
# BatchNorm has a gradient of exactly zero, computed as the round-off of terms far larger than 1e-9 (MobileViT's
# `reduce_1x1`: 1e-14, differing by 2e-14 between two summation orders); under SGD a parameter compares at what
# such a gradient moves it by (under Adam a zero gradient's round-off moves a parameter by the learning rate, one
# way or the other: no floor can tell that from a bug)
ZERO_GRAD_SHARE = 1e-6


def rel_diff(a: torch.Tensor, b: torch.Tensor, floor: float = ABS_FLOOR) -> float:
    """max |a - b| / max |b|, with |b| floored (at `floor`) so float64 round-off around zero is not a mismatch; a NaN
    or inf on one side only counts as an infinite difference, on both sides as none (an fp16 step whose
    gradients overflowed on both sides, then skipped by the loss scaler).

    >>> rel_diff(torch.tensor([1.0, 2.5]), torch.tensor([1.0, 2.0])), rel_diff(torch.zeros(2), torch.zeros(3))
    (0.25, inf)
    >>> nan = float("nan")
    >>> rel_diff(torch.tensor([nan]), torch.tensor([1.0])), rel_diff(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0]))
    (inf, 0.0)
    """
    if a.shape != b.shape:
        return float("inf")
    if not b.numel():
        return 0.0
    a, b = a.double(), b.double()  # bfloat16 would round the difference itself
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)):
        return float("inf")
    a, b = a[finite], b[finite]
    if not b.numel():
        return 0.0
    diff = (a - b).abs().max().item() / max(b.abs().max().item(), floor)
    return float("inf") if math.isnan(diff) else diff  # a NaN on either side is a mismatch, never hidden


def compare(program, ref: dict, ranks: dict, options: VerifyOptions, noise: dict | None = None) -> VerifyReport:
    """The VerifyReport of the ranks' results (assembled into global tensors) against the reference run, both
    trained as `options` says; with `noise` (a second reference run from nudged weights, see reference_runs)
    each tensor's tolerance is derived from its own noise, otherwise it is 1e-6.

    >>> double, double_inputs = to_double(model, inputs)
    >>> one_step = VerifyOptions(steps=1)
    >>> ref = reference_run(double, double_inputs, loss_fn, one_step)
    >>> ranks = simulate_ranks(program, lambda module: rank_run(module, double_inputs, one_step))
    >>> compare(program, ref, ranks, one_step).ok
    True
    """
    steps, dtype = options.steps, options.dtype
    report = VerifyReport(steps=steps, dtype=dtype_name(dtype), tolerance=None if noise is not None else TOLERANCE,
                          training=options.training)
    specs = program.output_specs
    nearest: dict[str, float] = {}  # kind -> the largest difference / tolerance so far

    grads = [g for g in (ref["grads"] or {}).values() if g is not None and g.numel()]
    largest = max((g.double().abs().max().item() for g in grads), default=0.0)
    floors = {"grads": max(ABS_FLOOR, ZERO_GRAD_SHARE * largest)} if math.isfinite(largest) else {}
    if "grads" in floors and options.optimizer == "sgd":  # what such a gradient moves a parameter by in SGD's steps
        floors["params"] = max(ABS_FLOOR, options.lr * steps * floors["grads"])

    def track(key, name, got, expected, index):
        floor = floors.get(key, ABS_FLOOR)
        value = rel_diff(got, expected, floor)
        if noise is None:
            own_noise, tolerance = None, TOLERANCE
        else:  # the same tensor of the nudged reference
            own_noise = rel_diff(noise[key][index], expected, floor)
            tolerance = tolerance_for(own_noise, coarsest_dtype(program.state.gm.graph, dtype))
        if value / tolerance >= nearest.get(key, -1.0):
            nearest[key] = value / tolerance
            report.max_diff[key], report.worst[key], report.tolerances[key] = value, name, tolerance
            if own_noise is not None:
                report.noise[key] = own_noise

    for step in range(steps):
        loss = program.assemble({r: res["loss"][step] for r, res in ranks.items()}, specs[0])
        track("loss", f"step {step}", loss, ref["loss"][step], step)
    if ref.get("loss_scale"):  # fp16: every rank skips and grows where GradScaler does, exactly
        got = {tuple(res["loss_scale"]) for res in ranks.values()}
        scales = torch.tensor(got.pop() if len(got) == 1 else [math.nan] * steps)
        report.max_diff["loss_scale"] = rel_diff(scales, torch.tensor(ref["loss_scale"]))
        report.worst["loss_scale"], report.tolerances["loss_scale"] = "scale after each step", TOLERANCE
        if noise is not None:
            report.noise["loss_scale"] = 0.0
    for i, expected in enumerate(ref["outputs"]):
        got = program.assemble({r: res["outputs"][i] for r, res in ranks.items()}, specs[1 + i])
        track("outputs", f"output {i}", got, expected, i)
    for kind in ("grads", "params"):
        for fqn, expected in (ref[kind] or {}).items():  # fp16: None when the scaler skipped every step
            name = program.canonical_param(fqn)
            blocks = {r: res[kind][name] for r, res in ranks.items() if name in res[kind]}  # pipelines: owners
            got = program.assemble(blocks, program.param_spec(name))
            track(kind, fqn, got, expected, fqn)
    report.collectives = ranks[0]["counts"]
    report.predicted = program.plan.predicted.to_dict()  # the dict form: verify --json prints it
    report.random_ops = len(program.random_ops)
    return report
