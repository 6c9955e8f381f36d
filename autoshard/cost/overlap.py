"""The step as the runtime overlaps it: the compute on one stream, each mesh axis's link on its own; gradient
buckets, ZeRO-3's gathers (prefetched) and its reduce-scatters (started in backward) run asynchronously,
the other collectives block the compute. One home for the formula: predict's `overlapped_step_s` and the
planned timeline of a flat program (autoshard/report/timeline.py) both come from `two_streams` over
`step_works(state)`.

Each work, in execution order (forward in graph order, backward in reverse, a parameter's gradient sync
released when backward has passed the parameter's first use):
  compute    runs on the compute stream: t += s
  blocking   a collective the compute waits for: it starts when its link is free, then t = its end
  async      released to its link at t, runs when the link is free; the compute goes on
The step ends at the latest of the compute stream and the links: the plain sum where nothing overlaps, the
compute plus the non-overlapped tail of the sync where it does (an estimate: a prefetched gather is taken
to be ready at its use when its link keeps up, and links of different axes do not contend).

The examples use a data-parallel MLP:

>>> import autoshard
>>> from autoshard.zoo import mlp
>>> model, inputs, loss_fn = mlp(n_layers=2)
>>> prog = autoshard.parallelize(model, (2,), inputs, loss_fn=loss_fn, axis_names=("dp",),
...                              hints={"input:0": {"dp": "S(0)"}})
"""
from __future__ import annotations

from dataclasses import dataclass

from autoshard.ir import meta
from autoshard.ir.meta import NODE_COST

_ASYNC_COLLECTIVES = ("param_all_gather",)  # ZeRO-3: prefetched forward, started in backward


@dataclass(frozen=True)
class Work:
    """One piece of a step: `kind` ("compute", "blocking" or "async"), its seconds, the link (mesh axis) a
    collective uses, and a letter for the timeline (F forward, B backward, C collective, S gradient sync).

    >>> Work("async", 0.5, "dp", "S")
    Work(kind='async', seconds=0.5, link='dp', label='S')
    """

    kind: str
    seconds: float
    link: str | None = None
    label: str = ""


def two_streams(works, overlap: float = 1.0) -> tuple[float, list]:
    """(step seconds, events): the works run as the module docstring says; events are (stream, label, start,
    end) with stream "compute" or a link's name. An async collective costs the compute stream (1 - `overlap`) of
    its seconds (the profile's `comm_overlap`: ranks whose communication shares the cores with their compute hide
    only part of it).

    >>> two_streams([Work("compute", 1.0, label="B"), Work("async", 3.0, "dp", "S"), Work("compute", 2.0)])[0]
    4.0
    >>> two_streams([Work("compute", 1.0), Work("blocking", 3.0, "tp", "C"), Work("compute", 2.0)])[0]  # a sum
    6.0
    >>> two_streams([Work("async", 2.0, "dp", "S"), Work("compute", 2.0)], overlap=0.25)[0]  # 2 + 0.75 x 2
    3.5
    """
    t, links, events = 0.0, {}, []
    for w in works:
        if w.seconds <= 0:
            continue
        if w.kind == "compute":
            events.append(("compute", w.label, t, t + w.seconds))
            t += w.seconds
            continue
        start = max(t, links.get(w.link, 0.0))
        links[w.link] = start + w.seconds
        events.append((w.link, w.label, start, start + w.seconds))
        if w.kind == "blocking":
            t = links[w.link]
        elif overlap < 1.0:  # the compute meanwhile is slowed by the share it cannot hide
            t += (1.0 - overlap) * w.seconds
    return max([t, *links.values()]), events


def step_works(state) -> list[Work]:
    """The works of one step from predict's per-node costs (forward, then backward with the syncs).

    >>> works = step_works(prog.state)
    >>> [w.label for w in works if w.kind != "compute"]  # two layers: the last layer's gradients sync first
    ['S', 'S', 'S', 'S']
    """
    nodes = list(state.gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    released: dict = {}  # position of a parameter's first use -> its gradient sync
    forward, backward = [], []
    for node in nodes:
        cost = node.meta.get(NODE_COST)
        if cost is None:
            continue
        if node.op == "placeholder":
            axes = state.grad_reduce.get(node.meta.get(meta.PATH), ())
            if cost.sync_s > 0 and axes and node.users:
                first = min(position[u] for u in node.users)
                released.setdefault(first, []).append(Work("async", cost.sync_s, axes[0], "S"))
            continue
        if node.meta.get(meta.KIND) == "comm":  # predict split its seconds into forward and backward
            info, fwd = node.meta[meta.COMM], cost.forward_seconds()
            kind = "async" if info["op"] in _ASYNC_COLLECTIVES else "blocking"
            forward.append(Work(kind, fwd, info["axis"], "C"))
            backward.append([Work(kind, cost.seconds - fwd, info["axis"], "C")])
        else:
            forward.append(Work("compute", cost.forward_seconds(), label="F"))
            backward.append([Work("compute", cost.seconds - cost.forward_seconds(), label="B")])
        backward[-1] += released.pop(position[node], [])
    return forward + [w for works in reversed(backward) for w in works]


def hidden_seconds(state) -> float:
    """Seconds of communication the overlap hides under compute (the plain sum minus `two_streams`' step).

    >>> 0 < hidden_seconds(prog.state) <= prog.plan.predicted["comm_s"]
    True
    """
    works = step_works(state)
    return max(0.0, sum(w.seconds for w in works) - two_streams(works, state.options.profile.comm_overlap)[0])
