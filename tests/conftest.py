"""Shared test helpers: a pretend CP mesh so single-process tests can shard for every rank."""

from __future__ import annotations

import os

import pytest
import torch

from dsv4.cp import SimulatedMesh

os.environ.setdefault("WANDB_MODE", "offline")


FakeMesh = SimulatedMesh  # short name used across the tests


@pytest.fixture
def fake_mesh():
    return FakeMesh


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
