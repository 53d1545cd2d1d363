"""Shared test helpers: a pretend CP mesh so single-process tests can shard for every rank."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Triton kernels run on CPU tensors under Triton's interpreter; set before anything imports triton (Lightning and
# torch import it, and Triton reads the setting once). On a GPU, TRITON_INTERPRET=0 tests the compiled kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread in every process the tests start (recipes, ranks, benchmarks): the suite runs one xdist worker
# per core, so more threads would oversubscribe the cores, and OpenMP's waiting threads then cost several times the
# work (a memory-plan rank with 2 threads beside a busy worker: 70 s; with 1: 7 s).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from dsv4.cp import SimulatedMesh  # noqa: E402

os.environ.setdefault("WANDB_MODE", "offline")
# prepared datasets (data.cache_dir) of every test and every recipe a test starts go to a fresh temporary directory
# of this test process (never ~/.cache/dsv4/data, which a concurrent test run would share), removed at exit
os.environ["DSV4_DATA_CACHE"] = tempfile.mkdtemp(prefix="dsv4-test-data-")
atexit.register(shutil.rmtree, os.environ["DSV4_DATA_CACHE"], ignore_errors=True)


FakeMesh = SimulatedMesh  # short name used across the tests


@pytest.fixture
def fake_mesh():
    return FakeMesh


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
