"""Kernel tests: the run's header names the device and whether the kernels are compiled or interpreted."""

import os

from tests.unit.kernels.device import DEVICE


def pytest_report_header(config):
    mode = "Triton interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"
    return f"dsv4 kernel tests: {DEVICE} tensors, {mode} kernels (DSV4_KERNEL_DEVICE, TRITON_INTERPRET)"
