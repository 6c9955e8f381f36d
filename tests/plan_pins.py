"""The plans the pinned cases produce: (case, fingerprint, md5 of plan.dumps()). `python tests/plan_pins.py`
prints them as JSON (tests/data/plan_pins.json holds the values from before issue 16's restructuring, regenerated
once by issue 17, which added `predicted.memory` and `predicted.overlapped_step_s` to every plan and records
pipeline candidates it did not re-plan as expected steps: without those, all 30 plans are the old ones)."""
import hashlib
import json
import sys
import warnings

import autoshard
from autoshard.zoo import FACTORIES as MODELS
from autoshard.zoo.hints import plan_hints

MESHES = {"2": ((2,), None), "2x2": ((2, 2), None), "2x2x2": ((2, 2, 2), None)}
DEFAULT_CASES = ["llama/2x2/hinted", "mlp/2x2/pipeline"]


def cases() -> list[str]:
    """Every pinned case: each zoo model automatic on (2,), (2,2), (2,2,2), hinted on dp x tp, and pipelined."""
    out = []
    for model in MODELS:
        out += [f"{model}/{mesh}/auto" for mesh in MESHES]
        out += [f"{model}/2x2/hinted", f"{model}/2x2/pipeline"]
    return out


def plan_of(case: str):
    """The Program of one pinned case."""
    model_name, mesh, how = case.split("/")
    model, inputs, loss_fn = MODELS[model_name]()
    shape = MESHES[mesh][0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "auto":
            return autoshard.parallelize(model, shape, inputs, loss_fn=loss_fn)
        if how == "hinted":
            return autoshard.parallelize(model, shape, inputs, loss_fn=loss_fn, axis_names=("dp", "tp"),
                                         hints=plan_hints(model_name, ("dp", "tp"), ("dp",), "tp"))
        return autoshard.parallelize(model, shape, inputs, loss_fn=loss_fn, axis_names=("pp", "dp"),
                                     hints={"input:0": {"dp": "S(0)"}}, pipeline={"microbatches": 2})


def pin(case: str) -> dict:
    """{fingerprint, md5} of the case's plan."""
    plan = plan_of(case).plan
    return {"fingerprint": plan.fingerprint, "md5": hashlib.md5(plan.dumps().encode()).hexdigest()}


if __name__ == "__main__":
    wanted = sys.argv[1:] or cases()
    print(json.dumps({case: pin(case) for case in wanted}, indent=1))
