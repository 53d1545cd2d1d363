"""Unit tests run with one intra-op thread: on a shared 2-core box OpenMP spinning makes 2 threads ~10x slower."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
