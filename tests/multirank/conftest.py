"""One pool of 8 gloo ranks for the whole session (starting ranks costs ~15 s on 2 cores)."""
import pytest

from autoshard.runtime.pool import WorkerPool


@pytest.fixture(scope="session")
def pool():
    workers = WorkerPool(world_size=8, timeout_s=120)
    yield workers
    workers.close()


@pytest.fixture(scope="session")
def pool_runner(pool):
    """A `runner` for autoshard.verify.verify.verify_factory that uses the shared pool."""
    return lambda task, world, *args: pool.run(task, *args)
