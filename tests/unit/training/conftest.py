"""In-process Trainer tests on ONE device: a one-rank gloo group met through a file store (no TCP port), torn down
afterwards together with the environment variables Lightning sets, so later tests see a clean process."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank_group(tmp_path):
    env = dict(os.environ)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
