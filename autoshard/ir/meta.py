"""The `node.meta["autoshard.*"]` keys every pass reads and writes, in one place.

  kind         "param" | "buffer" | "input" | "op" | "output"   (frontend)
  path         parameter/buffer FQN, "input:<i>", or the module path of an op (frontend)
  aliases      other FQNs of a tied parameter (frontend)
  hint         {axis index: Placement} fixed by the user (annotate)
  candidates   [per axis: [AxisStrategy]] feasible choices (strategies)
  choice       [per axis: AxisStrategy] the chosen strategy (solve)
  spec         Spec of the node's output(s) (solve)
  in_specs     [Spec] required of each tensor input position (solve)
  grad_partial [tuple of axes] per tensor input position where the gradient comes back partial (solve)
  comm         for inserted collectives: {"op", "axis", ...} (insert_comm)
  rng_index    a random op's number in the single device's order of draws (normalize)
  input_hint   {axis: {position: Placement}} wanted of an op's inputs by a hint on a module output (annotate)
  attention_hint {axis: "allgather" | "ring" | "alltoall"} an attention's context-parallel strategy (annotate)
  recompute    the recompute region (module path) a node belongs to (recompute)
  comm_cost    CommCost(fwd_bytes, bwd_bytes, seconds) on a collective (predict; cost/prediction.py)
  node_cost    NodeCost(seconds, memory_bytes, sync_s): what one node adds (predict; cost/prediction.py)
  stage        the pipeline stage of a node (cut_stages)
  grad         whether the value carries a gradient (normalize, for every node; `needs_grad` derives it by the
               same rule for nodes added later)
  fold_carried (layer, position) on a top-level op of a folded trace that carries a running value through the
               layers, e.g. `aux = aux + layer_aux` (frontend/fold.py: mark_carried; unfold removes it)

(The axes on which a parameter's gradient is reduced after backward are `state.grad_reduce`, by FQN.)

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}})
>>> weight = next(n for n in prog.state.gm.graph.nodes if n.meta.get(PATH) == "layers.0.weight")
>>> weight.meta[KIND], weight.meta[SPEC], prog.state.grad_reduce[weight.meta[PATH]]
('param', [R], ('dp',))
"""
KIND = "autoshard.kind"
PATH = "autoshard.path"
ALIASES = "autoshard.aliases"
HINT = "autoshard.hint"
CANDIDATES = "autoshard.candidates"
CHOICE = "autoshard.choice"
SPEC = "autoshard.spec"
IN_SPECS = "autoshard.in_specs"
GRAD_PARTIAL = "autoshard.grad_partial"
COMM = "autoshard.comm"
RNG_INDEX = "autoshard.rng_index"
INPUT_HINT = "autoshard.input_hint"
ATTENTION_HINT = "autoshard.attention_hint"
RECOMPUTE = "autoshard.recompute"
COMM_COST = "autoshard.comm_cost"
NODE_COST = "autoshard.node_cost"
STAGE = "autoshard.stage"
GRAD = "autoshard.grad"
FOLD_CARRIED = "autoshard.fold_carried"


def module_path(node) -> str:
    """Innermost module path of a node from export's nn_module_stack ('' at top level).

    >>> linear = next(n for n in prog.traced.gm.graph.nodes if n.name == "linear_default")
    >>> module_path(linear)
    'layers.0'
    """
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _strip_root(path)


def _strip_root(path: str) -> str:
    """Export names the model inside our train-step wrapper 'model'; users never see that prefix."""
    if path == "model":
        return ""
    return path.removeprefix("model.")
