import pytest
import torch
from _world import WorldPool


@pytest.fixture(scope="session")
def worlds():
    """Run a test body on 1, 2 or 4 ranks: ``worlds.run(world_size, body, **kwargs)``."""
    pool = WorldPool()
    yield pool
    pool.close()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
