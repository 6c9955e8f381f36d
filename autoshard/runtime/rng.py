"""Random ops on ranks (dropout and others): every rank's draws come from one user seed.

Each random op of the program (`RandomOp`, numbered in the single device's order) is drawn on a rank by
`random_op(index, op, *args)`, which codegen puts in place of the op. Two modes (`parallelize(..., rng=)`):

- ``"placement"`` (the default): masks follow placements. The op runs on the rank's local tensors with
  the default generator seeded from (seed, step, micro-batch, op, the rank's coordinates on the axes
  where the op's output is sharded): ranks holding copies of a tensor draw the same mask, shards draw
  independent ones. No extra work or memory.
- ``"exact"``: every rank draws each op's whole mask from one stream seeded like
  `torch.manual_seed(seed)`, in the single device's order and with its kernel, and keeps its block, so
  each rank's mask is its block of the mask the single device draws (verify passes with dropout on).
  Cost: each rank does the single device's whole random-number work and holds one op's full-size mask
  while it is drawn. In a pipeline the whole batch's mask is drawn once per step and micro-batch m takes
  block m of dim 0 (batch-first activations; a batch-dependent draw whose dim 0 is not a multiple of the
  micro-batch's rows is refused when the pipeline is planned).

Activation recomputation replays the masks: a region captures the rank's stream position (`capture`)
in forward and its recompute draws from it again.

>>> import torch
>>> from autoshard.ir.placement import R, S, Spec
>>> ops = [RandomOp(0, torch.ops.aten.dropout.default, (4, 6), torch.float64, Spec([S(0)]), "drop", (None, 0.5, True))]
>>> x = torch.ones(2, 6, dtype=torch.float64)  # rank 1's half of a [4, 6] activation sharded on dim 0
>>> exact = RankRng(ops, "exact", seed=3, coord=(1,), mesh_shape=(2,))
>>> exact.new_step()
>>> with exact.drawing():
...     mine = random_op(0, torch.ops.aten.dropout.default, x, 0.5, True)
>>> _ = torch.manual_seed(3)
>>> torch.equal(mine, torch.nn.functional.dropout(torch.ones(4, 6, dtype=torch.float64), 0.5)[2:])
True
>>> stream = RankRng(ops, "placement", seed=None, coord=(0,), mesh_shape=(2,))  # the default mode
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import threading
import weakref
from dataclasses import dataclass, field

import torch

from autoshard.ir.errors import UserInputError
from autoshard.ir.op_schema import call_argument
from autoshard.ir.placement import R, Shard, Spec, shard_tensor

aten = torch.ops.aten
MODES = ("placement", "exact")
_LOCAL = threading.local()
_SEED = {"value": 0}
_STREAMS: weakref.WeakSet = weakref.WeakSet()
_GENERATOR_LOCK = threading.RLock()

# How rng="exact" draws each op's whole mask: "noise" ops multiply their input by a mask drawn on ones
# (dropout's own kernel), "fresh" ops draw a tensor shaped like their input, "creation" ops draw what
# their size arguments say (they are replicated), "attention" draws the attention weights' dropout.
EXACT_KINDS = {
    aten.dropout.default: "noise", aten.native_dropout.default: "noise", aten.feature_dropout.default: "noise",
    aten.alpha_dropout.default: None,
    # nn.Dropout(inplace=True) (MobileNet's classifier): the same kernel and draw, written into its input
    aten.dropout_.default: "noise", aten.feature_dropout_.default: "noise",
    aten.bernoulli.p: "fresh", aten.rand_like.default: "fresh", aten.randn_like.default: "fresh",
    aten.rand.default: "creation", aten.randn.default: "creation",
    aten.randint.default: "creation", aten.randint.low: "creation", aten.randperm.default: "creation",
    aten.scaled_dot_product_attention.default: "attention",
    # the functional forms of the in-place samplers (`torch.empty_like(x).exponential_()`: a MoE router's noise)
    # draw a tensor shaped like their input whatever its values
    aten.exponential.default: "fresh", aten.uniform.default: "fresh", aten.normal_functional.default: "fresh",
    aten.geometric.default: "fresh", aten.log_normal.default: "fresh", aten.cauchy.default: "fresh",
}


def manual_seed(seed: int) -> None:
    """Seed every rank's random ops (dropout masks) from `seed`, like `torch.manual_seed` on one device:
    rank modules made afterwards start from it and live ones restart from it. The default seed is 0.

    >>> manual_seed(1234); _SEED["value"]
    1234
    >>> manual_seed(0)
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UserInputError(f"autoshard.manual_seed takes an int, got {seed!r}")
    _SEED["value"] = seed
    for stream in list(_STREAMS):
        stream.seed(seed)


def is_random(node_target, args=(), kwargs=None) -> bool:
    """Whether an op draws random numbers (torch tags such ops `nondeterministic_seeded`); attention
    only with a dropout probability.

    >>> is_random(aten.dropout.default, (None, 0.1, True)), is_random(aten.add.Tensor)
    (True, False)
    >>> is_random(aten.dropout.default, (None, 0.0, True)), is_random(aten.dropout.default, (None, 0.1, False))
    (False, False)
    >>> is_random(aten.scaled_dot_product_attention.default, (None, None, None, None, 0.0))
    False
    """
    tags = getattr(node_target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    if node_target is aten.scaled_dot_product_attention.default:
        return bool(_attention_dropout(args, kwargs or {}))
    if node_target in _DROPOUTS:  # dropout(x, p, train) with p = 0 or in eval draws nothing
        p = call_argument(node_target, args, kwargs, "p")
        train = call_argument(node_target, args, kwargs, "train")
        return not (isinstance(p, (int, float)) and p == 0) and train is not False
    return True


_DROPOUTS = (aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default,
             aten.alpha_dropout.default, aten.dropout_.default, aten.feature_dropout_.default)
_IN_PLACE = (aten.dropout_.default, aten.feature_dropout_.default)


def _attention_dropout(args, kwargs) -> float:
    return call_argument(aten.scaled_dot_product_attention.default, args, kwargs, "dropout_p")


@dataclass(frozen=True)
class RandomOp:
    """One random op of the program: its number in the single device's order, the global shape and
    dtype of what it draws (one micro-batch), and the placement of that draw on the mesh.

    >>> RandomOp(0, aten.dropout.default, (4, 6), torch.float32, Spec([S(0)]), "layers.0.drop").sharded_axes()
    (0,)
    """

    index: int
    target: object
    shape: tuple
    dtype: torch.dtype
    spec: Spec
    path: str
    args: tuple = ()  # the op's arguments with tensors as None (exact mode draws ops it does not run)
    kwargs: dict = field(default_factory=dict)
    batched: bool = True  # its draw depends on the inputs' batch (a pipeline draws it over the whole batch)

    def sharded_axes(self) -> tuple[int, ...]:
        """Mesh axes on which the draw is split: ranks that differ there draw different masks.

        >>> ops[0].sharded_axes()
        (0,)
        """
        return tuple(axis for axis, placement in enumerate(self.spec) if isinstance(placement, Shard))


class RankRng:
    """One rank's random stream: `mode` ("placement" or "exact"), its mesh coordinate, the program's
    random ops, and the step and micro-batch being drawn. `new_step()` starts a step (a rank module's
    forward; a pipeline's schedule step); `drawing(microbatch)` makes it the thread's stream.

    >>> exact.mode, exact.step
    ('exact', 0)
    """

    def __init__(self, ops, mode: str, seed: int | None, coord, mesh_shape, microbatches: int = 1,
                 needed=None):
        if mode not in MODES:
            raise UserInputError(f"rng={mode!r} is not a random-number mode: use one of {MODES}")
        self.ops = sorted(ops, key=lambda op: op.index)
        self.by_index = {op.index: op for op in self.ops}
        self.order = {op.index: i for i, op in enumerate(self.ops)}  # op -> its place in the draws
        self.mode = mode
        self.coord = tuple(coord)
        self.mesh_shape = tuple(mesh_shape)
        self.microbatches = microbatches
        self.needed = set(self.by_index) if needed is None else set(needed)
        self.seed(_SEED["value"] if seed is None else seed)
        _STREAMS.add(self)

    def seed(self, seed: int) -> None:
        """Restart from `seed` (exact mode: the state `torch.manual_seed(seed)` gives the single device).

        >>> stream.seed(7); stream.base_seed, stream.step
        (7, -1)
        """
        self.base_seed = seed
        self.step = -1
        self._state = {}  # device -> generator state of the exact stream
        self._next = 0  # exact: position in `ops` of the next op to draw this step
        self._blocks: dict = {}  # exact: (op index, micro-batch) -> this rank's block of the step's mask

    def state_dict(self) -> dict:
        """What a training checkpoint keeps of the stream, so that a resumed run draws the masks the
        uninterrupted one would: the seed, the step, and (exact mode) the stream's generator states.

        >>> sorted(stream.state_dict())
        ['exact', 'seed', 'step']
        """
        if self.mode == "exact" and self.step >= 0:
            self._advance(len(self.ops))  # the rest of this step's draws (other stages' ops) first
        return {"seed": self.base_seed, "step": self.step,
                "exact": {str(device): state.clone() for device, state in self._state.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state_dict()` (at a step boundary: the next `new_step` draws the next step's masks).

        >>> again = RankRng(ops, "placement", seed=None, coord=(0,), mesh_shape=(2,))
        >>> again.load_state_dict(stream.state_dict()); (again.base_seed, again.step) == (stream.base_seed, stream.step)
        True
        """
        self.seed(state["seed"])
        self.step = state["step"]
        self._state = {torch.device(device): value.clone() for device, value in state.get("exact", {}).items()}
        self._next = len(self.ops)  # the saved step was drawn to its end

    def new_step(self) -> None:
        """Start the next step; in exact mode first draw what the single device still draws this step
        (ops of other pipeline stages), so that the streams stay in step.

        >>> stream.new_step(); stream.step >= 0
        True
        """
        if self.mode == "exact" and self.step >= 0:
            self._advance(len(self.ops))
        self.step += 1
        self._next = 0
        self._blocks = {}

    @contextlib.contextmanager
    def drawing(self, microbatch: int = 0):
        """Random ops inside the block draw from this stream, for `microbatch` of the current step.

        >>> with stream.drawing():
        ...     current_position()[0] is stream
        True
        """
        previous = getattr(_LOCAL, "position", None)
        _LOCAL.position = (self, self.step, microbatch)
        try:
            yield self
        finally:
            _LOCAL.position = previous

    # ------------------------------------------------------------------ drawing
    def draw(self, index: int, step: int, microbatch: int, args, kwargs):
        """Random op `index` on this rank's `args` at (`step`, `microbatch`), as `random_op` calls it.

        >>> a, b = (stream.draw(0, 0, 0, (torch.ones(2, 6), 0.5, True), {}) for _ in range(2))
        >>> torch.equal(a, b)  # a recomputation draws the same mask, another step another one
        True
        >>> torch.equal(a, stream.draw(0, 1, 0, (torch.ones(2, 6), 0.5, True), {}))
        False
        """
        op = self.by_index[index]
        if self.mode == "placement":
            key = (self.base_seed, step, microbatch, index, tuple((a, self.coord[a]) for a in op.sharded_axes()))
            device = _device(args)
            return _seeded(device, _mix(key), lambda: op.target(*args, **kwargs))[0]
        if step != self.step:
            raise RuntimeError(f"autoshard: rng='exact' recomputed {op.path} (random op {index}) after the next "
                               "step began; run each step's backward before the next step's forward")
        self._advance(self.order[index] + 1, _device(args))
        return _apply(op, self._blocks[(index, microbatch)], args, kwargs)

    def _advance(self, end: int, device=None) -> None:
        """Draw ops [next, end) of this step from the exact stream, keeping this rank's blocks."""
        while self._next < end:
            op = self.ops[self._next]
            self._next += 1
            where = device or torch.device("cpu")
            if where not in self._state:
                self._state[where] = _seeded(where, self.base_seed, lambda: None)[1]
            full, self._state[where] = _seeded(where, self._state[where], lambda op=op, where=where: _template(
                op, self.microbatches, where))
            if op.index not in self.needed:
                continue
            spec = Spec([R if not isinstance(p, Shard) else p for p in op.spec])
            for m in range(self.microbatches):
                blocks = full if isinstance(full, tuple) else (full,)
                if op.batched:  # else every micro-batch uses the one draw, as the single device does
                    blocks = tuple(_microbatch(b, m, self.microbatches) for b in blocks)
                blocks = tuple(shard_tensor(b, spec, self.coord, self.mesh_shape) if b.dim() else b for b in blocks)
                self._blocks[(op.index, m)] = blocks if isinstance(full, tuple) else blocks[0]


def drawn_ops(module: torch.nn.Module) -> set[int]:
    """The numbers of the random ops a rank's module draws (its GraphModules' `random_op` calls).

    >>> drawn_ops(torch.nn.Linear(2, 2))
    set()
    """
    found = set()
    for sub in module.modules():
        if isinstance(sub, torch.fx.GraphModule):  # compile=True calls it through torch.compiler.disable
            found.update(n.args[0] for n in sub.graph.nodes if n.op == "call_function" and random_op in (
                n.target, getattr(n.target, "__wrapped__", None)))
    return found


def current_position():
    """(stream, step, micro-batch) of the calling thread, or None outside a rank module's forward;
    activation recomputation captures it in forward and draws from it again in backward.

    >>> current_position() is None
    True
    """
    return getattr(_LOCAL, "position", None)


@contextlib.contextmanager
def at_position(position):
    """Draw from a captured `current_position()` (a recomputed region's masks equal its forward's).

    >>> with at_position((stream, 0, 0)):
    ...     torch.equal(random_op(0, aten.dropout.default, torch.ones(2, 6), 0.5, True), stream.draw(0, 0, 0, (torch.ones(2, 6), 0.5, True), {}))
    True
    """
    previous = getattr(_LOCAL, "position", None)
    _LOCAL.position = position
    try:
        yield
    finally:
        _LOCAL.position = previous


def random_op(index: int, target, *args, **kwargs):
    """Codegen's stand-in for random op `index` (`target`) of the program: drawn from the rank's stream.

    >>> with stream.drawing():
    ...     random_op(0, aten.dropout.default, torch.ones(2, 6), 0.0, True)  # p = 0 drops nothing
    tensor([[1., 1., 1., 1., 1., 1.],
            [1., 1., 1., 1., 1., 1.]])
    """
    position = current_position()
    if position is None:
        raise RuntimeError(f"a per-rank autoshard module drew random op {index} ({target}) outside its rank: call it "
                           "through RankModule (prog.module(rank)) or prog.simulate(...), whose stream seeds it")
    stream, step, microbatch = position
    return stream.draw(index, step, microbatch, args, kwargs)


# ---------------------------------------------------------------------- helpers
def _mix(key) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 1


def _device(args) -> torch.device:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    return torch.device("cpu")


def _seeded(device: torch.device, seed_or_state, fn):
    """Run `fn` with the device's default generator at `seed_or_state`; (result, state after)."""
    cuda = device.type == "cuda"
    # The default generator is the process's: simulated ranks (threads) must not interleave their draws.
    with _GENERATOR_LOCK, torch.random.fork_rng(devices=[device] if cuda else []):
        if isinstance(seed_or_state, int):
            if cuda:
                torch.cuda.manual_seed(seed_or_state)
            else:
                torch.default_generator.manual_seed(seed_or_state)
        elif cuda:
            torch.cuda.set_rng_state(seed_or_state, device)
        else:
            torch.set_rng_state(seed_or_state)
        out = fn()
        after = torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()
    return out, after


def _full_shape(op: RandomOp, microbatches: int) -> tuple:
    shape = list(op.shape)
    if microbatches > 1 and shape and op.batched:
        shape[0] *= microbatches
    return tuple(shape)


def _on(device, value):
    return device if isinstance(value, torch.device) else value


def _template(op: RandomOp, microbatches: int, device):
    """What the single device draws for `op` over the whole batch (exact mode), with its own kernel."""
    kind = EXACT_KINDS.get(op.target)
    shape = _full_shape(op, microbatches)
    kwargs = {k: _on(device, v) for k, v in op.kwargs.items()}
    if kind == "noise":  # dropout(ones) is the mask scaled by 1 / (1 - p): x * it is dropout(x)
        return op.target(torch.ones(shape, dtype=op.dtype, device=device), *op.args[1:], **kwargs)
    if kind == "attention":  # the math kernel's dropout of the attention weights
        return aten.dropout.default(torch.ones(shape, dtype=op.dtype, device=device), _attention_dropout(
            op.args, op.kwargs), True)
    if kind == "fresh":
        return op.target(torch.empty(shape, dtype=op.dtype, device=device), *op.args[1:], **kwargs)
    if kind == "creation":
        return op.target(*op.args, **{**kwargs, "device": device} if "device" in kwargs else kwargs)
    raise UserInputError(f"rng='exact' cannot reproduce {op.target} at {op.path}: {exact_limit(op.target)}")


def exact_limit(target) -> str | None:
    """Why rng="exact" cannot honour `target` (None when it can).

    >>> exact_limit(aten.dropout.default) is None, exact_limit(aten.bernoulli.default)[:40]
    (True, 'its draw depends on its input values (th')
    """
    if EXACT_KINDS.get(target):
        return None
    if target is aten.bernoulli.default:
        return ("its draw depends on its input values (the probabilities), which no rank holds whole; use "
                "rng='placement', or draw with torch.rand_like(p) < p")
    return "autoshard has no rule to draw its single-device values on a rank; use rng='placement'"


def _microbatch(block: torch.Tensor, m: int, microbatches: int) -> torch.Tensor:
    if microbatches == 1 or not block.dim():
        return block
    size = block.shape[0] // microbatches
    return block.narrow(0, m * size, size)


def _apply(op: RandomOp, block, args, kwargs):
    """The op's result on this rank from its block of the single device's draw."""
    kind = EXACT_KINDS[op.target]
    if kind == "noise":
        if op.target is aten.native_dropout.default:
            noise, mask = block
            return args[0] * noise, mask
        if op.target in _IN_PLACE:
            return args[0].mul_(block)
        return args[0] * block
    if kind == "attention":
        return _attention(*args, **kwargs, noise=block)
    return block


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
               noise):
    """scaled_dot_product_attention as torch's math kernel computes it, with the attention weights'
    dropout mask given (`noise`: this rank's block of the single device's)."""
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    factor = math.sqrt(1.0 / math.sqrt(query.size(-1)) if scale is None else scale)
    scores = (query * factor) @ (key.transpose(-2, -1) * factor)
    length, source = query.size(-2), key.size(-2)
    if is_causal:
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    weights = aten._safe_softmax.default(scores, -1) if hasattr(aten, "_safe_softmax") else scores.softmax(-1)
    return (weights * noise) @ value
