"""The test helpers' port reservation: concurrent test runs never hand the same port to two recipes."""

from __future__ import annotations

from tests.e2e.helpers import reserved_port


def test_a_held_port_is_skipped():
    probes = iter([40001, 40001, 40002])  # the second reservation first probes the port the first one holds
    with reserved_port(lambda: next(probes)) as first:
        with reserved_port(lambda: next(probes)) as second:
            assert (first, second) == (40001, 40002)
    with reserved_port(lambda: 40001) as again:  # released on exit
        assert again == 40001
