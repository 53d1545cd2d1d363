"""The torchrun restart warning (:mod:`dsv4.training.elastic`)."""

from __future__ import annotations

import pytest

from dsv4.training.elastic import SHARE_STORE_VAR, restart_store_warning


@pytest.mark.parametrize("env", [
    {},  # not under torchrun
    {"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"},  # never restarted
    {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"},  # a fresh store every round
])
def test_no_warning_when_a_restart_cannot_see_an_earlier_rounds_keys(env):
    assert restart_store_warning(env) is None


def test_a_shared_store_under_max_restarts_names_the_setting():
    message = restart_store_warning({"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert "--max-restarts=3" in message and f"{SHARE_STORE_VAR}=1" in message
