"""Plan files: `Plan.save` / `Plan.load` as JSON only (never pickle), checked against a hand-written schema.

A plan file is `Plan.to_json()` plus `"fingerprint"` (the plan's sha256 prefix, or null after a
deliberate hand edit). Loading reads at most MAX_PLAN_FILE_BYTES, parses strict JSON (no NaN or
Infinity, nesting bounded by the parser) and checks every key and value against the schema below
before building the Plan; nothing in the file is ever executed. Every problem raises PlanFileError
naming the JSON path (and the node), what is wrong and what to do.

Schema (version 2):
  version      int, == PLAN_VERSION
  mesh         {"shape": [int >= 1], "names": [identifier], "named": bool}
  hints        the hint-file object (autoshard/frontend/hints.py), as the plan was made with
  nodes        [{"name", "op", "path", "kind", "type", "spec", "strategy", "collective", "axis": str,
                 "bytes_fwd", "bytes_bwd": int >= 0,
                 "choice": [per mesh axis: {"inputs": [placement], "output": placement, "method"?}] (empty for "comm";
                 "method" only where the placements do not say how the op runs: attention's "ring")}]
  grad_reduce  {parameter FQN: [mesh axis name]}
  predicted    {"step_time_s", "compute_s", "comm_s": number >= 0, "memory_bytes_per_rank": int >= 0,
                "comm_bytes_per_step": {axis name: {"fwd", "bwd", "sync": int >= 0}},
                optional "recompute_s", "overlapped_step_s": number >= 0, optional "memory": {"params",
                "grads", "optimizer", "gathered", "inputs", "activations": int >= 0}}
  fingerprint  16 hex digits or null

The examples save and load the plan of a small data-parallel MLP:

>>> import json, os, tempfile
>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}})
>>> folder = tempfile.mkdtemp()
>>> path = os.path.join(folder, "plan.json")
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import fields
from pathlib import Path

from autoshard.cost.prediction import MemoryParts, Prediction
from autoshard.frontend.hints import Hints
from autoshard.ir.errors import HintError, PlanError, UserInputError
from autoshard.ir.json_files import SHORT, read_json_file, short
from autoshard.ir.mesh import Mesh
from autoshard.ir.placement import Spec, parse_placement

PLAN_VERSION = 2  # 2: rows carry `choice` (per axis: {"inputs", "output"})

MAX_PLAN_FILE_BYTES = 64 << 20
_RESAVE = "save the plan again with prog.plan.save(path) (a plan file is written by autoshard, not by hand)"
_ROW_STR_KEYS = ("name", "op", "path", "kind", "type", "spec", "strategy", "collective", "axis")
_ROW_KEYS = (*_ROW_STR_KEYS, "bytes_fwd", "bytes_bwd", "choice")
_TOP_KEYS = ("version", "mesh", "hints", "nodes", "grad_reduce", "predicted", "fingerprint")
_OPTIONAL_TOP_KEYS = ("pipeline", "search")  # pipelined plans / unnamed-mesh search records
_PREDICTED_SECONDS = ("step_time_s", "compute_s", "comm_s")
_OPTIONAL_PREDICTED_SECONDS = ("recompute_s",  # activation checkpointing's recompute time
                               "overlapped_step_s")  # the step with the runtime's overlap (cost/overlap.py)
_MEMORY_PARTS = tuple(f.name for f in fields(MemoryParts))  # what predict.memory_parts splits


class PlanFileError(PlanError):
    """A plan file that cannot be read, is not valid JSON, or does not follow the plan schema.

    >>> plan_parts({"version": 2})
    Traceback (most recent call last):
    ...
    autoshard.plan.io.PlanFileError: plan file plan: at the top level: a plan lacks the keys 'mesh', ...
    """


class PlanMismatchError(PlanError):
    """A plan applied to a model, example inputs or mesh other than the ones it was made for.

    >>> autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("tp",), plan=prog.plan)
    Traceback (most recent call last):
    ...
    autoshard.plan.io.PlanMismatchError: the plan was made for mesh Mesh(dp=2) but parallelize got Mesh(tp=2); ...
    """


def save_plan(plan, path) -> None:
    """Write `plan` as indented, sorted JSON with its fingerprint (atomically: temp file, then rename);
    `Plan.save` calls it.

    >>> save_plan(prog.plan, path)
    >>> json.load(open(path))["fingerprint"] == prog.plan.fingerprint
    True
    """
    if not isinstance(path, (str, os.PathLike)):
        raise UserInputError(f"Plan.save takes a file path (str or os.PathLike), got {short(path)}")
    data = plan.to_json()
    data["fingerprint"] = plan.fingerprint
    text = json.dumps(data, sort_keys=True, indent=1) + "\n"
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise PlanFileError(f"cannot write plan file {str(path)!r}: {exc.strerror or exc}; check that the "
                            "directory exists and is writable") from exc


def read_plan_file(path) -> dict:
    """The checked content of a plan file (`Plan.load` builds the Plan from it; see `plan_parts`).

    >>> save_plan(prog.plan, path)
    >>> sorted(read_plan_file(path))
    ['fingerprint', 'grad_reduce', 'hints', 'mesh', 'predicted', 'records', 'rows', 'source']
    """
    return plan_parts(read_json_file(path, "plan file", MAX_PLAN_FILE_BYTES, PlanFileError), repr(str(path)))


def plan_parts(data, source: str = "plan") -> dict:
    """Check `data` against the plan schema; return what a Plan is built from: mesh, rows (each row's fields),
    grad_reduce, hints, predicted, records (pipeline/search), the claimed fingerprint and the source.

    >>> data = dict(json.loads(prog.plan.dumps()), fingerprint=prog.plan.fingerprint)  # a plan file's content
    >>> plan_parts(data)["rows"][0]["name"]
    'p_model_layers_0_weight'
    """
    return {**_Checker(source).plan(data), "source": source}


def check_fingerprint(plan, claimed, source: str) -> None:
    """A plan file's fingerprint must be its content's (null: deliberately edited by hand).

    >>> check_fingerprint(prog.plan, "0000000000000000", "example")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    autoshard.plan.io.PlanFileError: plan file example: at fingerprint: the file says '0000000000000000' but ...
    """
    if claimed is not None and claimed != plan.fingerprint:
        raise _Checker(source).fail("fingerprint", f"the file says {SHORT.repr(claimed)} but its content hashes to "
                                                   f"{plan.fingerprint!r}: it was changed after it was saved, or is "
                                                   "corrupt", "save it again; if you edited it on purpose, set "
                                                   "\"fingerprint\" to null")


class _Checker:
    """Schema checks with messages that name the file, the JSON path and the node."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, where: str, problem: str, fix: str = _RESAVE) -> PlanFileError:
        return PlanFileError(f"plan file {self.source}: at {where}: {problem}; {fix}")

    def obj(self, value, where: str, keys, what: str) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, f"expected {what} (a JSON object), got {short(value)}")
        missing = [k for k in keys if k not in value]
        if missing:
            raise self.fail(where, f"{what} lacks the key{'s' if len(missing) > 1 else ''} "
                                   f"{', '.join(map(repr, missing))}")
        extra = sorted(k for k in value if k not in keys)
        if extra:
            raise self.fail(where, f"unexpected key {extra[0]!r} in {what} (it has exactly the keys "
                                   f"{', '.join(map(repr, keys))})")
        return value

    def string(self, value, where: str) -> str:
        if not isinstance(value, str):
            raise self.fail(where, f"expected a string, got {short(value)}")
        return value

    def count(self, value, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(where, f"expected an integer >= 0, got {short(value)}")
        return value

    def seconds(self, value, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise self.fail(where, f"expected a finite number >= 0, got {short(value)}")
        return value

    def listing(self, value, where: str, what: str) -> list:
        if not isinstance(value, list):
            raise self.fail(where, f"expected {what} (a JSON array), got {short(value)}")
        return value

    def placement(self, value, where: str) -> str:
        try:
            return repr(parse_placement(value, where))
        except ValueError:
            raise self.fail(where, f"malformed placement {SHORT.repr(value)}: a placement is 'S(<dim>)', 'R' or "
                                   "'P', e.g. 'S(0)'") from None

    def plan(self, data) -> dict:
        if not isinstance(data, dict):
            raise self.fail("the top level", f"expected a plan (a JSON object), got {short(data)}")
        if "version" not in data:
            raise self.fail("the top level", f"no 'version' key, so this is not an autoshard plan file (plans "
                                             f"carry \"version\": {PLAN_VERSION})", "check the path")
        version = data["version"]
        if type(version) is not int or version != PLAN_VERSION:
            raise self.fail("version", f"the file has plan format version {SHORT.repr(version)} but this autoshard "
                                       f"reads version {PLAN_VERSION}",
                            "re-plan with this version of autoshard (parallelize without plan=) and save again")
        optional = tuple(k for k in _OPTIONAL_TOP_KEYS if isinstance(data, dict) and k in data)
        self.obj(data, "the top level", _TOP_KEYS + optional, "a plan")
        mesh = self.mesh(data["mesh"])
        hints = self.hints(data["hints"])
        rows = self.rows(data["nodes"], mesh)
        grad_reduce = self.grad_reduce(data["grad_reduce"], mesh)
        predicted = self.predicted(data["predicted"], mesh)
        records = {key: self.obj(data[key], key, tuple(data[key]) if isinstance(data[key], dict) else (),
                                 f"the {key} record") for key in optional}  # pipelined plans: records only
        fingerprint = data["fingerprint"]
        if fingerprint is not None:
            self.string(fingerprint, "fingerprint")
        return {"mesh": mesh, "rows": rows, "grad_reduce": grad_reduce, "hints": hints, "predicted": predicted,
                "records": records, "fingerprint": fingerprint}

    def mesh(self, value) -> Mesh:
        self.obj(value, "mesh", ("shape", "names", "named"), "a mesh")
        shape = self.listing(value["shape"], "mesh.shape", "the axis sizes")
        for i, size in enumerate(shape):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise self.fail(f"mesh.shape[{i}]", f"expected an axis size (integer >= 1), got {short(size)}")
        names = self.listing(value["names"], "mesh.names", "the axis names")
        for i, name in enumerate(names):
            self.string(name, f"mesh.names[{i}]")
        if not isinstance(value["named"], bool):
            raise self.fail("mesh.named", f"expected true or false, got {short(value['named'])}")
        try:
            mesh = Mesh(tuple(shape), tuple(names))
        except UserInputError as exc:
            raise self.fail("mesh", str(exc)) from None
        if not value["named"]:
            if mesh.names != tuple(f"a{i}" for i in range(mesh.ndim)):
                raise self.fail("mesh.names", f"an unnamed mesh has the axis names a0, a1, ..., got {list(names)}")
            mesh = Mesh(mesh.shape)
        return mesh

    def hints(self, value) -> dict:
        if not isinstance(value, dict):
            raise self.fail("hints", f"expected the hints (a JSON object, {{}} when none), got {short(value)}")
        try:
            return Hints.parse(value, source="hints").to_json()
        except HintError as exc:
            raise self.fail("hints", str(exc)) from None

    def rows(self, value, mesh: Mesh) -> list[dict]:
        rows, seen = [], {}
        for i, row in enumerate(self.listing(value, "nodes", "the list of nodes")):
            name = row.get("name") if isinstance(row, dict) else None
            label = f" (node {name!r})" if isinstance(name, str) else ""

            def at(key="", i=i, label=label):
                return f"nodes[{i}]{'.' + key if key else ''}{label}"

            staged = isinstance(row, dict) and "stage" in row
            self.obj(row, at(), _ROW_KEYS + (("stage",) if staged else ()), "a node")
            fields = {key: self.string(row[key], at(key)) for key in _ROW_STR_KEYS}
            if not fields["name"]:
                raise self.fail(at("name"), "a node name is empty")
            if fields["name"] in seen:
                raise self.fail(at("name"), f"the name repeats nodes[{seen[fields['name']]}]")
            seen[fields["name"]] = i
            fields["bytes_fwd"] = self.count(row["bytes_fwd"], at("bytes_fwd"))
            fields["bytes_bwd"] = self.count(row["bytes_bwd"], at("bytes_bwd"))
            if fields["axis"] and fields["axis"] not in mesh.names:
                raise self.fail(at("axis"), f"{fields['axis']!r} is not an axis of {mesh!r}")
            try:
                spec = Spec.parse(fields["spec"])
            except ValueError:
                raise self.fail(at("spec"), f"malformed spec {SHORT.repr(fields['spec'])}: write one placement "
                                            "per mesh axis, e.g. '[S(0), R]'") from None
            if len(spec) != mesh.ndim:
                raise self.fail(at("spec"), f"{fields['spec']!r} has {len(spec)} placements but the mesh {mesh!r} "
                                            f"has {mesh.ndim} axes")
            fields["spec"] = repr(spec)
            fields["choice"] = self.choice(row["choice"], at, fields["kind"], spec, mesh)
            if staged:
                fields["stage"] = self.count(row["stage"], at("stage"))
            rows.append(fields)
        return rows

    def choice(self, value, at, kind: str, spec: Spec, mesh: Mesh) -> list:
        value = self.listing(value, at("choice"), "the chosen strategy per mesh axis")
        wanted = 0 if kind == "comm" else mesh.ndim
        if len(value) != wanted:
            expected = ("no chosen strategy for an inserted collective (kind 'comm')" if kind == "comm" else
                        f"one chosen strategy per mesh axis of {mesh!r} ({wanted})")
            raise self.fail(at("choice"), f"expected {expected}, got {len(value)}")
        out, n_inputs = [], None
        for axis, strategy in enumerate(value):
            self.obj(strategy, at(f"choice[{axis}]"), ("inputs", "output", "method") if isinstance(strategy, dict)
                     and "method" in strategy else ("inputs", "output"), "a strategy")
            inputs = self.listing(strategy["inputs"], at(f"choice[{axis}].inputs"), "the input placements")
            if n_inputs is not None and len(inputs) != n_inputs:
                raise self.fail(at(f"choice[{axis}].inputs"), f"{len(inputs)} input placements, but axis 0 gives "
                                                              f"{n_inputs}")
            n_inputs = len(inputs)
            out.append({"inputs": [self.placement(p, at(f"choice[{axis}].inputs[{j}]")) for j, p in enumerate(inputs)],
                        "output": self.placement(strategy["output"], at(f"choice[{axis}].output"))})
            if "method" in strategy:
                out[-1]["method"] = self.string(strategy["method"], at(f"choice[{axis}].method"))
        if out and Spec(parse_placement(s["output"]) for s in out) != spec:
            outputs = "[" + ", ".join(s["output"] for s in out) + "]"
            raise self.fail(at("choice"), f"the chosen outputs {outputs} disagree with the node's spec {spec!r}")
        return out

    def grad_reduce(self, value, mesh: Mesh) -> dict:
        if not isinstance(value, dict):
            raise self.fail("grad_reduce", f"expected {{parameter: [axis names]}} (a JSON object), got {short(value)}")
        out = {}
        for fqn, axes in value.items():
            where = f"grad_reduce[{fqn!r}]"
            for j, axis in enumerate(self.listing(axes, where, "the axis names")):
                if axis not in mesh.names:
                    raise self.fail(f"{where}[{j}]", f"{SHORT.repr(axis)} is not an axis of {mesh!r}")
            if len(set(axes)) != len(axes):
                raise self.fail(where, f"the axes {axes} repeat a name")
            out[fqn] = tuple(axes)
        return out

    def predicted(self, value, mesh: Mesh) -> Prediction:
        optional = tuple(k for k in _OPTIONAL_PREDICTED_SECONDS if isinstance(value, dict) and k in value)
        parts = ("memory",) if isinstance(value, dict) and "memory" in value else ()
        keys = (*_PREDICTED_SECONDS, "comm_bytes_per_step", "memory_bytes_per_rank", *optional, *parts)
        self.obj(value, "predicted", keys, "the predicted costs")
        if parts:
            for key in self.obj(value["memory"], "predicted.memory", _MEMORY_PARTS, "memory parts"):
                self.count(value["memory"][key], f"predicted.memory.{key}")
        for key in (*_PREDICTED_SECONDS, *optional):
            self.seconds(value[key], f"predicted.{key}")
        self.count(value["memory_bytes_per_rank"], "predicted.memory_bytes_per_rank")
        per_axis = self.obj(value["comm_bytes_per_step"], "predicted.comm_bytes_per_step", mesh.names,
                            "bytes per mesh axis")
        for axis in mesh.names:
            where = f"predicted.comm_bytes_per_step.{axis}"
            for key in self.obj(per_axis[axis], where, ("fwd", "bwd", "sync"), "bytes per step"):
                self.count(per_axis[axis][key], f"{where}.{key}")
        return Prediction.from_dict(value)
