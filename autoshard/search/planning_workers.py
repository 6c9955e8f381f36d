"""Independent planning tasks in worker processes: the mesh search plans each candidate shape on its own
(autoshard/search/mesh_search.py), so on a machine with several cores the shapes are planned side by side.

Workers are forked after the model is traced (they inherit the traced graph and every cache the parent filled) and
return only picklable results: figures and plan files (`Plan.to_json`), never compiled programs; the parent applies
the one plan it keeps (`parallelize(..., plan=)`: decisions applied, no solving). Each task's warnings are caught
and returned with its result, so the parent tells those of the plan it keeps, once.

Fork is used only where it is safe and pays: on Linux, with more than one core this process may run on, outside
torch.distributed (a process group's threads and sockets do not survive a fork) and before CUDA is initialised.
`AUTOSHARD_PLAN_WORKERS=1` plans in this process; another number caps the workers.

>>> [square for square, caught in run_tasks(lambda x: x * x, [1, 2, 3], workers=1)]
[1, 4, 9]
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import pickle
import sys

import torch

from autoshard.ir.errors import PlanError
from autoshard.ir.warn_once import caught_warnings, warn_once
from autoshard.solver.highs import set_solver_threads, stop_solver_threads

WORKERS_ENV = "AUTOSHARD_PLAN_WORKERS"

# The tasks the forked workers run, by name: set before the fork, read by `_run_in_worker` in the children.
_TASKS: dict = {}


def planning_workers(tasks: int) -> int:
    """How many processes plan `tasks` independent tasks: one per core this process may run on (at most one per
    task), capped by AUTOSHARD_PLAN_WORKERS; 1 where forking is not safe (see the module docstring).

    >>> planning_workers(1)
    1
    """
    if tasks < 2 or not sys.platform.startswith("linux") or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return 1
    if torch.cuda.is_initialized():  # a forked child cannot use CUDA again (tracing a model on the GPU would)
        return 1
    cores = len(os.sched_getaffinity(0))
    limit = os.environ.get(WORKERS_ENV, "").strip()
    if limit:
        try:
            cores = min(cores, max(int(limit), 1))
        except ValueError:
            warn_once(f"autoshard: {WORKERS_ENV}={limit!r} is not a number of processes; using {cores}",
                      stacklevel=2)
    return max(min(cores, tasks), 1)


def run_tasks(task, items: list, workers: int) -> list[tuple]:
    """[(task(item), the warnings it gave), ...] in the order of `items`: in this process when `workers` is 1, else
    in `workers` forked processes (each result must pickle; an exception a task raises is raised here).

    >>> import warnings
    >>> def noisy(x):
    ...     warnings.warn(f"autoshard: task {x}")
    ...     return -x
    >>> run_tasks(noisy, [1, 2], workers=2) == run_tasks(noisy, [1, 2], workers=1)
    True
    >>> run_tasks(noisy, [1], workers=1)
    [(-1, [('autoshard: task 1', <class 'UserWarning'>)])]
    """
    if workers <= 1:
        return [_caught(task, item) for item in items]
    with worker_pool({"task": lambda index: task(items[index])}, workers) as pool:  # the items are inherited
        futures = [pool.submit("task", index) for index in range(len(items))]
        return [future.result() for future in futures]


class WorkerPool:
    """Forked worker processes (`worker_pool`): `submit(name, item)` runs the pool's task `name` on `item` (pickled to
    the worker) and returns a future of what `run_tasks` gives for it.

    >>> with worker_pool({"square": lambda x: x * x}, workers=1) as pool:
    ...     type(pool).__name__
    'WorkerPool'
    """

    def __init__(self, executor):
        self._executor = executor

    def submit(self, name: str, item) -> concurrent.futures.Future:
        """Queue `tasks[name](item)`: the first submit forks every worker; a free worker takes the oldest queued task.

        >>> with worker_pool({"square": lambda x: x * x}, workers=1) as pool:
        ...     pool.submit("square", 3).result()
        (9, [])
        """
        return self._executor.submit(_run_in_worker, name, item)


@contextlib.contextmanager
def worker_pool(tasks: dict, workers: int):
    """Within the block, a WorkerPool of `workers` processes running `tasks` (name -> function; the workers are forked
    at the first submit and inherit them, so a task need not pickle, only its items and results). A worker that
    dies (killed for memory) raises PlanError, not a hang.

    >>> with worker_pool({"negate": lambda x: -x, "double": lambda x: 2 * x}, workers=2) as pool:
    ...     futures = [pool.submit("negate", 1), pool.submit("double", 1)]
    >>> [future.result()[0] for future in futures]
    [-1, 2]
    """
    global _TASKS
    _TASKS = dict(tasks)
    stop_solver_threads()
    try:  # an executor, not a Pool: a worker that dies raises BrokenProcessPool, not a hang
        with concurrent.futures.ProcessPoolExecutor(max(workers, 1), mp_context=multiprocessing.get_context("fork"),
                                                    initializer=_start_worker, initargs=(workers,)) as executor:
            yield WorkerPool(executor)
    except concurrent.futures.process.BrokenProcessPool as exc:
        raise PlanError(f"a planning worker process died before it finished ({exc}): the system may have killed "
                        f"it for memory ({workers} plan side by side); set {WORKERS_ENV}=1 to plan in this "
                        "process, or a smaller number") from None
    finally:
        _TASKS = {}


def _start_worker(workers: int) -> None:
    """A forked worker's set-up: its share of the cores for the ILP solver (the workers solve side by side)."""
    set_solver_threads(max(len(os.sched_getaffinity(0)) // max(workers, 1), 1))


def _run_in_worker(name: str, item) -> tuple:
    return _caught(_TASKS[name], item)


def _caught(task, item) -> tuple:
    """(task(item), [(message, category), ...] of the warnings it gave): each task tells its own warnings once
    (a fresh `warning_scope`), whatever the tasks before it told."""
    with caught_warnings() as caught:
        result = task(item)
    return result, [(str(w.message), w.category) for w in caught]


def tell(caught: list) -> None:
    """Give the warnings a task caught (`run_tasks`), each once in the current `warning_scope`.

    >>> import warnings
    >>> from autoshard.ir.warn_once import warning_scope
    >>> with warnings.catch_warnings(record=True) as seen, warning_scope():
    ...     warnings.simplefilter("always")
    ...     tell([("autoshard: once", UserWarning), ("autoshard: once", UserWarning)])
    >>> [str(w.message) for w in seen]
    ['autoshard: once']
    """
    for message, category in caught:
        warn_once(message, category, stacklevel=3)


def picklable(exc: BaseException) -> BaseException:
    """`exc`, or a PlanError with its message when it does not pickle (a worker returns it to the parent).

    >>> picklable(ValueError("x")).args
    ('x',)
    """
    try:
        pickle.dumps(exc)
    except Exception:  # noqa: BLE001 -- whatever stops pickling it, its message goes back
        return PlanError(str(exc))
    return exc
