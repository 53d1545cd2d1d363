"""End-to-end: `recipes/train_dspark.py` (DSpark drafter training) in subprocesses, the tiny V4.1 target on CPU.

One module-scoped set of runs over the same 24 short documents (a JSONL file, the byte tokenizer) and the same
target (a seeded ``v41_tiny`` exported in float32, ``model.checkpoint``), 4 optimizer steps of 2 rows each:
online on one process (its drafter exported beside a copy of the target), offline from a capture of the same
documents, online on 2 data-parallel ranks with the drafter's experts expert-parallel over both (``ep=2``), online
on 2 context-parallel ranks (``cp=2``), and the online run killed after its step-2 checkpoint and run again.
Asserted: offline equals online, and the 2-rank expert-parallel run and the 2-rank context-parallel run equal the
one-process run (per-step losses within 1e-4 relative), the resumed run continues the
uninterrupted trajectory (1e-5), the run logs the drafter's terms and the real accepted length, and the exported
drafter loads and decodes through ``recipes/eval_dspark.py``.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from tests.e2e.helpers import kill_after, losses, run_recipe

pytestmark = pytest.mark.e2e

SCRIPT = "recipes/train_dspark.py"
STEPS = ["trainer.max_steps=4", "checkpoint.every_n_steps=2", "scheduler.warmup_steps=1"]
TRAIN = ["seq_len=256", "micro_batch_size=2", "drafter.num_anchors=8", "drafter.eval_prompts=1",
         "drafter.eval_new_tokens=4", "logger=csv", *STEPS]
WORDS = "the quick brown fox jumps over a lazy dog and then runs far away into the forest where birds sing".split()


def _documents(path) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(24):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40)))}) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from dsv4.checkpoint import export_hf_checkpoint
    from dsv4.config import DSV4Config
    from dsv4.speculative.target import build_frozen_target

    base = tmp_path_factory.mktemp("dspark_train")
    _documents(base / "docs.jsonl")
    target = base / "target"
    export_hf_checkpoint(build_frozen_target(DSV4Config.preset("v41_tiny"), seed=0), str(target), dtype="float32")
    shutil.copytree(target, base / "hf")
    common = ["data=jsonl", f"data.path={base / 'docs.jsonl'}", "data.tokenizer=byte", f"model.checkpoint={target}"]
    run_recipe([*common, "model=v41_tiny", "seq_len=256", "max_document_tokens=null", "progress=false",
                f"output_dir={base / 'features'}"], base / "capture", script="recipes/capture_dspark.py")
    run_recipe([*common, *TRAIN, f"export.hf_dir={base / 'hf'}"], base / "online", script=SCRIPT)
    run_recipe([*common, *TRAIN, "mode=offline", f"features={base / 'features'}"], base / "offline", script=SCRIPT)
    run_recipe([*common, *TRAIN, "dp=2", "micro_batch_size=1", "ep=2", "dispatcher=alltoall"], base / "dp2_ep2",
               script=SCRIPT)
    run_recipe([*common, *TRAIN, "cp=2"], base / "cp2", script=SCRIPT)
    return {"base": base, "common": common}


def _close(a: dict[int, float], b: dict[int, float], tol: float) -> None:
    assert sorted(a) == sorted(b) == [0, 1, 2, 3], (a, b)
    for step in a:
        assert abs(a[step] - b[step]) <= tol * abs(b[step]), (step, a[step], b[step])


def test_online_run_logs_the_drafter_terms_and_the_real_accepted_length(runs):
    import csv

    rows = list(csv.DictReader(open(runs["base"] / "online" / "csv" / "metrics.csv")))
    logged = {k for row in rows for k, v in row.items() if v}
    for key in ("train/loss", "train/ce", "train/l1", "train/confidence", "train/tau", "train/accept_rate/0",
                "val/acceptance_length", "val/acceptance_per_position/4"):
        assert key in logged, key
    length = [float(r["val/acceptance_length"]) for r in rows if r.get("val/acceptance_length")]
    assert len(length) == 1 and 1.0 <= length[0] <= 6.0  # once, after the last step


def test_offline_from_a_capture_equals_online(runs):
    _close(losses(runs["base"] / "offline"), losses(runs["base"] / "online"), 1e-4)


def test_two_ranks_with_expert_parallel_drafter_equal_one_replica(runs):
    """dp=2 (one row each) with ep=2 (each rank holds half of every stage's routed experts, alltoall dispatch)
    against one replica taking both rows: the same global batch."""
    _close(losses(runs["base"] / "dp2_ep2"), losses(runs["base"] / "online"), 1e-4)


def test_context_parallel_equals_one_rank(runs):
    """cp=2: the target runs each row in two chunks, each rank trains the blocks anchored in its chunk, the context
    before a chunk and the teachers after it travel (tests/distributed/test_drafter_cp.py counts them)."""
    _close(losses(runs["base"] / "cp2"), losses(runs["base"] / "online"), 1e-4)


def test_kill_and_resume_continues_the_same_trajectory(runs, tmp_path):
    """SIGKILL the online run after its step-2 checkpoint, rerun the same command: steps 2-3 as uninterrupted."""
    args = [*runs["common"], *TRAIN]
    kill_after(args, tmp_path, tmp_path / "checkpoints" / "step2.ckpt" / "meta.pt", script=SCRIPT)
    run_recipe(args, tmp_path, script=SCRIPT)
    resumed, reference = losses(tmp_path), losses(runs["base"] / "online")
    for step in (2, 3):
        assert abs(resumed[step] - reference[step]) <= 1e-5 * abs(reference[step]), (step, resumed, reference)


def test_the_exported_drafter_sits_beside_the_target_and_decodes(runs, tmp_path):
    from dsv4.config import DSV4Config
    from dsv4.model.v41.drafter import DSparkDrafter
    from dsv4.speculative import load_dspark_drafter

    hf = runs["base"] / "hf"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert {f for k, f in index["weight_map"].items() if k.startswith("mtp.")} == {"dspark-00001-of-00001.safetensors"}
    drafter = load_dspark_drafter(str(hf))
    torch.manual_seed(1234)
    fresh = DSparkDrafter(DSV4Config.preset("v41_tiny"))
    assert not torch.equal(drafter.layers[0].main_proj.weight, fresh.layers[0].main_proj.weight.bfloat16().float())
    proc = run_recipe(["data=jsonl", f"data.path={runs['base'] / 'docs.jsonl'}", "data.tokenizer=byte",
                       f"model.checkpoint={hf}", f"drafter.checkpoint={hf}", "num_prompts=2", "max_new_tokens=8",
                       "prompt_tokens=16", "logger=none"], tmp_path, script="recipes/eval_dspark.py")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["drafter"] == str(hf) and 1.0 <= summary["acceptance_length"] <= 6.0
