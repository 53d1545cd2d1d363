"""Unit tests run with one intra-op thread (on a shared 2-core box OpenMP spinning makes 2 threads ~10x slower); the
one-rank process group fixture for in-process tests of distributed code."""

import os

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _environment_restored():
    """Every test leaves ``os.environ`` as it found it: ``run_finetune`` seeds through Lightning, which exports
    ``PL_GLOBAL_SEED`` / ``PL_SEED_WORKERS``, and a later in-process ``Trainer.fit`` would then re-create its data
    loaders with seeded workers (a test's result depending on which tests ran before it in the same process)."""
    env = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(env)


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def one_rank_group(tmp_path):
    """In-process tests on ONE rank: a one-rank gloo group met through a file store (no TCP port), torn down
    afterwards together with the environment variables Lightning sets, so later tests see a clean process."""
    env = dict(os.environ)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
