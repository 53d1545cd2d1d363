"""Bad configs and bad data fail at start-up with a message naming the key and the value; nothing is written."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import FAST, run_recipe

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "overrides, message",
    [  # one of each kind through the command line; every semantic check is in tests/unit/training/test_run.py
        (["cpp=4"], "Key 'cpp' not in 'FinetuneConfig'"),
        (["model.bogus=1"], "Key 'bogus' not in 'ModelConfig'"),
        (["seq_len=1000", "cp=2"], "`seq_len`=1000 must be a positive multiple of cp x shard multiple = 2 x 128 = 256"),
    ],
)
def test_bad_config_fails_before_start(tmp_path, overrides, message):
    proc = run_recipe([*FAST, *overrides], tmp_path / "run", check=False)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "resolved_config.yaml").exists()


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "def f():\\n    return 1\\n"}\n{not json}\n')
    proc = run_recipe([*FAST, "data=jsonl", f"data.path={data}"], tmp_path / "run", check=False)
    assert proc.returncode != 0
    assert f"{data}:2" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_empty_dataset_is_refused(tmp_path):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    proc = run_recipe([*FAST, "data=jsonl", f"data.path={data}"], tmp_path / "run", check=False)
    assert proc.returncode != 0
    assert "empty" in proc.stderr.lower() or "no documents" in proc.stderr.lower(), proc.stderr[-3000:]
