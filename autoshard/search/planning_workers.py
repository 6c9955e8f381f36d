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
from autoshard.solver.highs import stop_solver_threads

WORKERS_ENV = "AUTOSHARD_PLAN_WORKERS"

# The task the forked workers run: set just before the fork, read by `_run_in_worker` in the children.
_TASK: tuple | None = None


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
    with tasks_in_background(task, items, workers) as results:
        return results()


@contextlib.contextmanager
def tasks_in_background(task, items: list, workers: int):
    """Within the block, `task` runs over `items` in `workers` forked processes (forked as the block starts) while
    this process goes on; the block gets a function that waits for them and returns what `run_tasks` would.

    >>> with tasks_in_background(lambda x: x + 1, [1, 2], workers=1) as results:
    ...     here = sum(range(4))  # this process's own work meanwhile
    >>> here, [value for value, caught in results()]
    (6, [2, 3])
    """
    global _TASK
    _TASK = (task, items)
    stop_solver_threads()
    try:  # an executor, not a Pool: a worker that dies (killed for memory) raises BrokenProcessPool, not a hang
        with concurrent.futures.ProcessPoolExecutor(max(workers, 1),
                                                    mp_context=multiprocessing.get_context("fork")) as pool:
            futures = [pool.submit(_run_in_worker, index) for index in range(len(items))]  # every fork happens here
            yield lambda: [future.result() for future in futures]
    except concurrent.futures.process.BrokenProcessPool as exc:
        raise PlanError(f"a planning worker process died before it finished ({exc}): the system may have killed "
                        f"it for memory ({workers} plan side by side); set {WORKERS_ENV}=1 to plan in this "
                        "process, or a smaller number") from None
    finally:
        _TASK = None


def _run_in_worker(index: int) -> tuple:
    task, items = _TASK
    return _caught(task, items[index])


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
