"""The catalogue of hand plans (DDP, FSDP, DDP x TP, FSDP x TP, TP x SP, FSDP x TP x PP, TP x CP, EP inside dp) written for
any model from its traced roles; `parallelize(model, mesh.shape, inputs, **plan.options)` plans one, and the
planner's search compares its own plan with every one that applies (autoshard/search/hand_plan_search.py)."""
from autoshard.catalogue.hand_plans import (
    CATALOGUE,
    HandPlan,
    NotApplicable,
    ddp,
    dp_tp,
    ep_dp,
    fsdp,
    fsdp_tp,
    fsdp_tp_pp,
    model_roles_of,
    tp_cp,
    tp_sp,
)
from autoshard.catalogue.roles import ModelRoles, model_roles

__all__ = ["CATALOGUE", "HandPlan", "ModelRoles", "NotApplicable", "ddp", "dp_tp", "ep_dp", "fsdp", "fsdp_tp", "fsdp_tp_pp",
           "model_roles", "model_roles_of", "tp_cp", "tp_sp"]
