"""One rule for GPU tests: marked `gpu`, skipped where CUDA is absent."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    # Tiny matmuls on a shared 2-core machine: OpenMP spinning makes 2 threads ~10x slower than 1.
    torch.set_num_threads(1)
