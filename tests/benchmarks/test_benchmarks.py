"""The benchmark scripts' own logic: the RSS high-water reset, and smoke runs that check what they measure."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import current_rss_kib, peak_rss_kib, reset_peak_rss  # noqa: E402
from tests.e2e.helpers import recipe_env, reserved_port  # noqa: E402


def _run(script: str, *args: str, timeout: float = 1800) -> list[dict]:
    """Run a benchmark script; ``timeout`` is a safety net against a hang, never a performance check."""
    with reserved_port() as port:  # a recipe the script starts meets its ranks there
        proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=REPO,
                              capture_output=True, text=True, timeout=timeout, env=recipe_env(port))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_reset_peak_rss_forgets_an_earlier_transient_allocation():
    import torch

    big = torch.ones(64 * 2**20)  # 256 MiB, touched
    del big
    assert peak_rss_kib() - current_rss_kib() > 200 * 1024  # the high-water mark remembers it
    reset_peak_rss()
    assert peak_rss_kib() - current_rss_kib() < 50 * 1024


def test_batch_prep_measures_dsv4_and_says_whether_nemo_was_measured():
    import importlib.util

    rows = _run("batch_prep.py", "--rows", "2", "--seq-len", "2048", "--docs", "8", "--repeats", "1")
    names = {(r["name"], r["shape"].get("impl")) for r in rows}
    assert {("batch_prep.repad.throughput", "dsv4"), ("batch_prep.repad_shard.throughput", "dsv4")} <= names
    assert all(set(r) == {"name", "shape", "value", "unit"} and r["value"] > 0 for r in rows)
    speedup = [r for r in rows if r["name"] == "batch_prep.repad.speedup_vs_nemo"]
    if importlib.util.find_spec("nemo_automodel") is None:
        assert not speedup and all(r["shape"]["nemo_automodel"] == "not installed" for r in rows)
    for r in speedup:  # measured side by side only after the outputs were found equal
        assert r["shape"]["same_output"] is True
        assert ("batch_prep.repad.throughput", "nemo_automodel") in names


@pytest.mark.e2e
def test_cp_memory_measures_only_the_step_and_reports_the_ratio():
    rows = _run("cp_memory.py", "--seq-len", "2048", "--cp", "1", "2")
    by_name = {(r["name"], r["shape"].get("cp"), r["shape"].get("rank")): r["value"] for r in rows}
    one, two = by_name[("cp_memory.peak_rss_delta.max_over_ranks", 1, None)], \
        by_name[("cp_memory.peak_rss_delta.max_over_ranks", 2, None)]
    assert 0 < two < one
    assert by_name[("cp_memory.ratio_to_cp1", 2, None)] == pytest.approx(two / one, abs=1e-3)


@pytest.mark.e2e
def test_train_throughput_measures_only_the_steps_after_warmup():
    rows = _run("train_throughput.py", "--cp", "1", "--steps", "4", "--warmup", "2", "--seq-len", "256",
                "--max-bytes", "100000", "--padding-seq-lens", "1024")
    (speed,) = [r for r in rows if r["name"] == "train_throughput.tokens_per_s"]
    assert speed["shape"]["steps_measured"] == 2 and speed["value"] > 0
    assert all(set(r) == {"name", "shape", "value", "unit"} for r in rows)


@pytest.mark.e2e
@pytest.mark.timeout(3600)  # the script's own safety net below, longer than the suite's
def test_memory_plan_agrees_with_the_measured_step():
    """The tiny model's plan within 10% of the tensors a measured step holds at its peak, at CP 1 and 2, for block
    recompute, the logits-chunk variant and a LoRA run on a kept FP8 base (512 tokens: docs/memory.md gives the
    numbers at longer sequences)."""
    rows = _run("memory_plan.py", "--models", "tiny", "--cp", "1", "2", "--seq-len", "512", "--variants", "block",
                "logits", "lora_fp8", timeout=3600)
    ratios = [r for r in rows if r["name"] == "memory_plan.tensors_over_predicted"]
    assert len(ratios) == 6 and all(0.9 <= r["value"] <= 1.1 for r in ratios), ratios
    assert all(r["value"] > 0 for r in rows if r["name"] == "memory_plan.measured_rss")


@pytest.mark.e2e
def test_dspark_plan_agrees_with_the_measured_step():
    """The drafter-training plan's total within 10% of the tensors the recipe's step holds at its peak (target forward,
    drafter step, AdamW) on 1 rank and on 2 (dp 2, ep 2), v41_tiny at 512 tokens."""
    rows = _run("dspark_plan.py", "--measure", "--world", "1", "2", "--seq-len", "512")
    ratios = {r["shape"]["world"]: r["value"] for r in rows if r["name"] == "dspark_plan.tensors_over_predicted"}
    assert set(ratios) == {1, 2} and all(0.9 <= v <= 1.1 for v in ratios.values()), ratios


@pytest.mark.e2e
def test_v41_memory_plan_agrees_with_the_measured_step():
    """DeepSeek-V4.1 (v41_tiny: CSA2 shared state, Engram tables row-sharded and n-gram ids, fake quantisation,
    single-pass hyper-connections): the plan's total within 20% of the tensors a measured step holds at its peak, on
    one rank and on 2 CP ranks (256 tokens; docs/memory.md gives CP 4 and the mid-size model)."""
    rows = _run("memory_plan.py", "--models", "v41_tiny", "--cp", "1", "2", "--seq-len", "256", "--variants", "none",
                timeout=3600)
    ratios = {r["shape"]["cp"]: r["value"] for r in rows if r["name"] == "memory_plan.tensors_over_predicted"}
    assert set(ratios) == {1, 2} and all(0.8 <= v <= 1.2 for v in ratios.values()), ratios


@pytest.mark.e2e
def test_attention_cpu_checks_the_dense_path_and_reports_the_speedup():
    rows = _run("attention_cpu.py", "--seq-lens", "256", "--ratios", "4", "0", "--repeats", "1")
    speedups = {r["shape"]["ratio"]: r["value"] for r in rows if r["name"] == "attention_cpu.speedup_over_dense"}
    assert set(speedups) == {4, 0} and all(v > 0 for v in speedups.values())


@pytest.mark.e2e
def test_lora_benchmark_measures_the_kept_base_and_the_merge():
    measured = _run("lora.py", "--quick")
    rows = {r["name"]: r for r in measured}
    assert rows["lora.kept_base_bytes.vs_checkpoint"]["value"] == 1.0  # the release's own bytes, nothing more
    assert 0.25 < rows["lora.kept_base_bytes.vs_bf16"]["value"] < 0.5  # FP4 experts + FP8 linears vs 2 bytes each
    assert rows["lora.requantized_merge.update_lost"]["value"] > 0
    variants = {r["shape"]["variant"] for r in measured if r["name"] == "lora.step.tokens_per_s"}
    assert variants == {"full", "lora_bf16", "lora_fp8"}


@pytest.mark.e2e
def test_indexer_loss_benchmark_reports_cost_and_learning():
    rows = _run("indexer_loss.py", "--quick")
    names = {r["name"] for r in rows}
    assert names == {"indexer_loss.step_tokens_per_s", "indexer_loss.step_overhead", "indexer_loss.kl",
                     "indexer_loss.selected_mass"}
    mass = {r["shape"]["when"]: r["value"] for r in rows if r["name"] == "indexer_loss.selected_mass"}
    assert 0 < mass["before"] < 1 and 0 < mass["after"] < 1
    assert all(r["value"] > 0 for r in rows)


def test_fake_quant_benchmark_measures_both_families():
    """One row of 128 tokens per tiny model: every measurement of both families, as JSON rows of the four keys,
    positive and finite (the rounding moves the logits; agreement is a share)."""
    rows = _run("fake_quant.py", "--quick")
    assert all(set(r) == {"name", "shape", "value", "unit"} for r in rows)
    got = {(r["shape"]["model"], r["name"]): r["value"] for r in rows}
    names = ["fake_quant.max_abs_logit_diff", "fake_quant.mean_abs_logit_diff", "fake_quant.kl",
             "fake_quant.top1_agreement", "fake_quant.max_logit"]
    assert sorted(got) == sorted((m, n) for m in ("tiny", "v41_tiny") for n in names)
    assert all(math.isfinite(v) and v > 0 for v in got.values()), got
    for model in ("tiny", "v41_tiny"):
        assert got[model, "fake_quant.mean_abs_logit_diff"] <= got[model, "fake_quant.max_abs_logit_diff"]
        assert got[model, "fake_quant.top1_agreement"] <= 1


@pytest.mark.e2e
def test_packed_attention_benchmark_compares_a_packed_row_with_its_documents():
    rows = _run("packed_attention.py", "--docs", "4", "--doc-len", "256", "--repeats", "1")
    ratios = {r["shape"]["ratio"]: r["value"] for r in rows if r["name"] == "packed_attention.packed_over_documents"}
    assert set(ratios) == {4, 128} and all(v > 0 for v in ratios.values())
    assert all(r["shape"]["tokens"] == 1024 for r in rows)


@pytest.mark.e2e
def test_cp_traffic_counts_every_kind_against_the_layout_bound():
    """Three small layouts on 2 ranks, DeepSeek-V4 (tiny) and V4.1 (v41_tiny): every exchange kind is classified, the
    bytes the wire tap sees at the torch.distributed calls equal the counters' on every rank, each rank receives
    within 1.25x of the first-principles bound (payload, backward and metadata together), and over all ranks the
    forward and the backward bytes equal their bounds (1.00), a document beginning 2 tokens before the rank boundary
    under a 16-token window included; the V4.1 bounds worked out by hand; an unknown kind fails."""
    from cp_traffic import category, lower_bound

    layouts = ("starts_and_padding", "two_rows", "late_starts_window16")
    rows = _run("cp_traffic.py", "--seq-len", "1024", "--cp", "2", "--layouts", *layouts, "--models", "tiny", "v41_tiny")
    ratios = [r for r in rows if r["name"] == "cp_traffic.ratio"]
    assert len(ratios) == 12 and all(r["value"] is not None and r["value"] <= 1.25 for r in ratios), ratios
    assert {r["shape"]["preset"] for r in ratios} == {"tiny", "v41_tiny"}
    for part in ("forward", "backward"):
        totals = [r for r in rows if r["name"] == f"cp_traffic.{part}_ratio_all_ranks"]
        assert len(totals) == 6 and all(r["value"] == 1.0 for r in totals), totals
    windows = {(r["shape"]["preset"], r["shape"]["layout"]): r["shape"]["sliding_window"] for r in ratios}
    assert windows[("v41_tiny", "late_starts_window16")] == 16 and windows[("v41_tiny", "two_rows")] == 4
    counted = {json.dumps(r["shape"]): r["value"] for r in rows if r["name"] == "cp_traffic.counted"}
    wire = {json.dumps(r["shape"]): r["value"] for r in rows if r["name"] == "cp_traffic.wire"}
    assert len(wire) == 12 and wire == counted and all(v > 0 for v in wire.values())
    bounds = lower_bound("two_rows", 1024, 2)  # row 0 continues into rank 1: payload only there, backward to rank 0
    assert bounds[0]["payload"] == 0 < bounds[1]["payload"] and 0 < bounds[0]["backward"] <= bounds[1]["payload"]
    # metadata: two int32 from the other chunk per row; rank 0 also reads row 0's next MTP id and label from rank 1
    assert bounds[1]["backward"] == 0 and (bounds[0]["metadata"], bounds[1]["metadata"]) == (2 * 8 + 8, 2 * 8)
    # V4.1, v41_tiny (12 layers, window 4, head_dim 32, index_head_dim 32, Full layers 2 and 4 at ratio 2 and 6 at
    # ratio 1, Engram 4-grams): row 0's chunk 1 continues a 512-token document. Each layer's 3 window keys, then per
    # Full layer every earlier window's row and index key (256 + 256 + 512 windows), then 3 token ids; the rows'
    # and keys' gradients (not the frozen keys', not the ids') go back to rank 0. No MTP.
    v41 = lower_bound("two_rows", 1024, 2, "v41_tiny")
    halo, rows_of = 12 * 3 * 32 * 4, (256 + 256 + 512) * 32 * 4
    assert v41[1] == {"payload": halo + 2 * rows_of + 3 * 4, "backward": 0, "metadata": 2 * 8}
    assert v41[0] == {"payload": 0, "backward": halo + rows_of, "metadata": 2 * 8}
    # window 16, and rank 1's document began 2 tokens before it (column 510): its queries read those 2 of the 15 keys
    # the window could reach in each layer, 1 + 1 + 2 earlier windows' rows and keys, and 2 of Engram's 3 token ids;
    # one row: two int32 of metadata from the other chunk
    late = lower_bound("late_starts_window16", 1024, 2, "v41_tiny")
    halo, rows_of = 12 * 2 * 32 * 4, (1 + 1 + 2) * 32 * 4
    assert late[1] == {"payload": halo + 2 * rows_of + 2 * 4, "backward": 0, "metadata": 8}
    assert late[0] == {"payload": 0, "backward": halo + rows_of, "metadata": 8}
    assert category("halo.backward") == "backward" and category("metadata") == "metadata"
    assert category("engram_ids") == "payload"
    with pytest.raises(KeyError, match="unknown exchange kind 'all_gather'"):
        category("all_gather")


@pytest.mark.e2e
def test_dspark_capture_benchmark_reports_the_slot_ratio_and_the_token_bound():
    """Four documents, two to a row, on the V4.1-style preset (alignment 2): the token bound is the one-document-per-
    row slots over the tokens and the row bound the same over two rows as wide as the wider one's tokens, worked out
    here from the same seeded lengths; the packed layout's slot ratio cannot exceed them."""
    import torch

    rows = _run("dspark_capture.py", "--presets", "v4_ratio2_tiny", "--docs", "4", "--min-len", "8", "--max-len", "64",
                "--docs-per-row", "2", "--repeats", "1")
    value = {r["name"]: r["value"] for r in rows}
    lengths = torch.randint(8, 65, (4,), generator=torch.Generator().manual_seed(0)).tolist()
    one_per_row_slots = 4 * (-(-max(lengths) // 2) * 2)
    assert value["dspark_capture_token_bound"] == pytest.approx(one_per_row_slots / sum(lengths))
    widest_row = max(sum(lengths[:2]), sum(lengths[2:]))
    assert value["dspark_capture_row_bound"] == pytest.approx(one_per_row_slots / (2 * widest_row))
    assert 1.0 <= value["dspark_capture_slot_ratio"] <= value["dspark_capture_row_bound"] \
        <= value["dspark_capture_token_bound"]
    assert value["dspark_capture_packed_speedup"] > 0


def test_checkpoint_export_benchmark_stays_inside_the_stated_bound():
    """The three ways (one process, 2 EP ranks, the DCP converter) write the same files (the script asserts it);
    each export's extra memory stays near one converted tensor, the converter's under the two copies and a converted
    one it states, and none comes near the model (about 10x the largest tensor here). The converter's --merge of a
    LoRA run writes the one-process merged export's files and stays inside its bound (one kept block of the base,
    three fp32 copies of the largest tensor and its bf16 form), under half the whole kept model."""
    rows = {r["name"]: r for r in _run("checkpoint_export.py")}  # 669 MB: allocator noise small next to 64 MiB
    assert set(rows) == {"checkpoint_export.one_process", "checkpoint_export.ep2_rank0", "checkpoint_export.ep2_rank1",
                         "checkpoint_export.convert", "checkpoint_export.convert_merge"}
    for name in ("one_process", "ep2_rank0", "ep2_rank1"):
        assert rows[f"checkpoint_export.{name}"]["value"] < 1.5, rows[f"checkpoint_export.{name}"]
    assert rows["checkpoint_export.convert"]["value"] < 3, rows["checkpoint_export.convert"]
    shape = rows["checkpoint_export.convert"]["shape"]
    assert shape["model_bytes"] > 9 * shape["largest_tensor_fp32_bytes"]
    merge = rows["checkpoint_export.convert_merge"]  # --merge: one kept block + the largest tensor's temporaries
    assert merge["value"] < 1, merge
    assert merge["shape"]["kept_model_bytes"] > 2 * merge["shape"]["merge_bound_bytes"]


def test_data_prepare_writes_chats_and_a_tokenizer_with_the_chat_formats_tokens(tmp_path):
    """The benchmark's inputs (its timed runs are too slow for a smoke test): valid chat records of about the
    requested size and a trained BPE under which the DeepSeek-V4 chat format applies."""
    import data_prepare

    from dsv4.data.defaults import resolve_data_source
    from dsv4.data.sources import jsonl_records

    data = tmp_path / "chats.jsonl"
    count = data_prepare.write_chats(data, 0.05)
    assert count > 0 and 50_000 <= data.stat().st_size < 80_000
    assert jsonl_records(data)[0] == count
    ckpt = data_prepare.train_tokenizer(tmp_path / "ckpt", data, vocab=400)
    source = resolve_data_source({"kind": "jsonl", "path": str(data), "tokenizer": "auto"}, str(ckpt), 129280)
    assert source["tokenizer"] == str(ckpt) and source["chat_template"] == "deepseek_v4"


def test_data_prepare_tree_memory_attributes_ranks_and_helpers():
    """``--recipe``'s poller: the launcher is rank 0, a child started with ``LOCAL_RANK`` is that rank, any other
    descendant a helper; each keeps its own peak private memory (RssAnon)."""
    import os
    import time

    import data_prepare

    hold = "import time; b = bytearray({mb} << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)"
    launcher = (
        "import os, subprocess, sys\n"
        f"rank = subprocess.Popen([sys.executable, '-c', {hold.format(mb=96)!r}], env={{**os.environ, 'LOCAL_RANK': '1'}})\n"
        f"helper = subprocess.Popen([sys.executable, '-c', {hold.format(mb=8)!r}])\n"
        "rank.wait(); helper.wait()\n")
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    proc = subprocess.Popen([sys.executable, "-c", launcher], env=env)
    memory = data_prepare.TreeMemory(proc.pid, interval=0.05)
    proc.wait()
    time.sleep(0.1)
    memory.stop()
    assert set(memory.ranks) == {0, 1}
    assert memory.ranks[1]["rss_anon"] >= 90 << 10  # KiB
    assert memory.ranks[0]["rss_anon"] < 60 << 10 and memory.helpers["rss_anon"] < 60 << 10
    assert memory.ranks[1]["hwm"] >= memory.ranks[1]["rss_anon"]


def test_optimizer_state_plot_draws_each_curves_moving_average(tmp_path):
    from optimizer_state import plot_losses

    curves = {"moments float32": [1.0, 2.0, 3.0, 4.0], "moments <bf16> & more": [4.0, 2.0, 2.0, 0.0]}
    fig = plot_losses(curves, 2, tmp_path / "plot.svg", "tiny model: train/loss")
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == list(curves)
    assert [line.get_xydata().tolist() for line in lines] == [[[0, 1.0], [1, 1.5], [2, 2.5], [3, 3.5]],
                                                              [[0, 4.0], [1, 3.0], [2, 2.0], [3, 1.0]]]
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == list(curves)
    svg = (tmp_path / "plot.svg").read_text()
    assert svg.startswith("<?xml") and "<svg" in svg
    # text stays text: the title, the axis labels and the legend (escaped) are in the file
    for text in ("tiny model: train/loss", "optimizer step", "moments float32", "moments &lt;bf16&gt; &amp; more"):
        assert text in svg, text
    plot_losses(curves, 2, tmp_path / "again.svg", "tiny model: train/loss")
    assert (tmp_path / "again.svg").read_text() == svg  # no date, fixed ids: the same curves, the same file


def test_optimizer_state_moving_average_and_model_overrides():
    from optimizer_state import model_overrides, moving_average

    assert moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert model_overrides("tiny") == ["model=tiny"]
    assert "model.compress_ratios=[0,4,128,4,128,4,128,4]" in model_overrides("mid")
    with pytest.raises(ValueError, match="unknown model 'huge'"):
        model_overrides("huge")


def test_restart_loop_counts_a_trial_only_with_one_restart_a_complete_resume_and_the_oracles_losses():
    """The restart loop's judgement (its trials run torchrun for minutes: not in the suite), on hand-made trials."""
    from restart_loop import newest_checkpoint_by, resumed_steps, verdict

    ref = {0: 1.0, 1: 0.9, 2: 0.8}
    assert verdict(ref, dict(ref), 0, 1, [2, 2], 2) == "recovered"
    assert verdict(ref, dict(ref), 0, 1, [4, 4], 2) == "recovered"  # the kill landed after a later save
    assert verdict(ref, {**ref, 2: 0.8000001}, 0, 1, [2, 2], 2) == "step 2: loss 0.8000001 != 0.8"
    assert verdict(ref, {0: 1.0, 1: 0.9}, 0, 1, [2, 2], 2) == "logged steps [0, 1] != [0, 1, 2]"
    assert verdict(ref, ref, None, 1, [2, 2], 2).startswith("hung")
    assert verdict(ref, ref, 1, 1, [2, 2], 2) == "torchrun exited 1"
    assert verdict(ref, ref, 0, 2, [2, 2, 2, 2], 2) == "2 restarts, not 1"
    for resumed in ([0, 0], [2], [2, 4]):  # older than the committed checkpoint, one rank, two checkpoints
        assert verdict(ref, ref, 0, 1, resumed, 2).startswith(f"resumed from steps {resumed}")
    assert [newest_checkpoint_by(row, 2) for row in range(5)] == [0, 2, 2, 4, 4]
    log = ("[2026-12-03 15:18:19,994][dsv4][INFO] - resuming from /r/checkpoints/last.ckpt (step 2)\n"
           "[2026-12-03 15:18:20,001][dsv4][WARNING] - not resuming from /r/checkpoints/step4.ckpt.partial: incomplete\n"
           "[2026-12-03 15:18:22,776][dsv4][INFO] - resuming from /r/checkpoints/last.ckpt (step 2)\n")
    assert resumed_steps(log) == [2, 2]
