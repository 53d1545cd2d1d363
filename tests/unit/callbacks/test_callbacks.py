"""Callbacks driven by a fake LightningModule (last_step_stats + a recording log), plus one real-Trainer smoke."""

from __future__ import annotations

import pytest
import torch

from dsv4.callbacks import CPTrafficCallback, MemoryCallback, PaddingCallback, ThroughputCallback
from dsv4.batch import TokenBatch
from dsv4.config import DSV4Config
from dsv4.flops import document_training_flops, training_flops_per_token
from dsv4.training.stats import StepStats, batch_statistics, document_flops, step_stats_from


class FakeModule:
    """What the callbacks touch: ``last_step_stats``, ``device``, optional ``config``/``model``, ``log``."""

    def __init__(self, config=None, model=None):
        self.last_step_stats = None
        self.device = torch.device("cpu")
        if config is not None:
            self.config = config
        if model is not None:
            self.model = model
        self.calls: list[tuple[str, float, dict]] = []

    def log(self, name, value, **kwargs):
        self.calls.append((name, value, kwargs))

    def logged(self) -> dict[str, float]:
        """The last value per name, then clear."""
        out = {name: value for name, value, _ in self.calls}
        self.calls.clear()
        return out


def make_stats(step, real=1000, label=900, time_s=1.0, seq_len=512, rows=2, pack=0, align=0, world=4, cp=2,
               traffic=None, flops=None) -> StepStats:
    return StepStats(
        step=step, seq_len=seq_len, rows=rows, slots=rows * seq_len, real_tokens=real, label_tokens=label,
        pack_padding=pack, alignment_padding=align, cp=cp, dp=world // cp, world_size=world, step_time_s=time_s,
        cp_traffic=traffic or {}, model_flops=flops,
    )


def run(callback, module, stats=None):
    if stats is not None:
        module.last_step_stats = stats
    callback.on_train_batch_end(None, module, None, None, 0)
    return module.logged()


# ------------------------------------------------------------------------------------------------ throughput
def test_throughput_window_warmup_and_exact_values():
    cb = ThroughputCallback(window=2, warmup_steps=1, peak_flops=None)
    module = FakeModule()
    assert run(cb, module) == {}  # no stats yet: no-op
    assert run(cb, module, make_stats(1, real=1000, label=900, time_s=2.0)) == {}  # warm-up step skipped
    got = run(cb, module, make_stats(2, real=800, label=700, time_s=1.0))
    assert got == {
        "perf/tokens_per_s": 800.0,
        "perf/tokens_per_s_per_device": 200.0,  # world_size 4
        "perf/label_tokens_per_s": 700.0,
        "perf/step_time_s": 1.0,
    }
    assert run(cb, module) == {}  # same step again: not counted twice
    got = run(cb, module, make_stats(3, real=600, label=500, time_s=3.0))
    assert got["perf/tokens_per_s"] == pytest.approx(1400 / 4)
    assert got["perf/tokens_per_s_per_device"] == pytest.approx(1400 / 4 / 4)
    assert got["perf/label_tokens_per_s"] == pytest.approx(1200 / 4)
    assert got["perf/step_time_s"] == pytest.approx(2.0)
    module.last_step_stats = make_stats(4, real=1000, label=900, time_s=1.0)
    cb.on_train_batch_end(None, module, None, None, 0)
    kwargs = {name: kw for name, _, kw in module.calls}
    got = module.logged()
    assert got["perf/tokens_per_s"] == pytest.approx(1600 / 4)  # window = steps 3 and 4
    assert got["perf/label_tokens_per_s"] == pytest.approx(1400 / 4)
    assert kwargs["perf/tokens_per_s"]["prog_bar"] is True
    assert kwargs["perf/label_tokens_per_s"]["prog_bar"] is False
    assert all(kw["on_step"] and not kw["on_epoch"] and not kw["sync_dist"] for kw in kwargs.values())


def _two_document_row(lengths, width, multiple=128):
    """One row holding documents of ``lengths`` on multiples of ``multiple``; the rest padding."""
    seq = torch.zeros(1, width, dtype=torch.long)
    pos = torch.zeros(1, width, dtype=torch.long)
    start = 0
    for d, n in enumerate(lengths):
        seq[0, start:start + n], pos[0, start:start + n] = d + 1, torch.arange(n)
        start += -(-n // multiple) * multiple
    return TokenBatch(torch.ones(1, width, dtype=torch.long), torch.where(seq > 0, 1, -100), seq, pos)


def test_throughput_tflops_and_mfu_count_each_document_at_its_own_length():
    """A 2048-slot row of two 1000-token documents: attention FLOPs grow with each document's length, not the row's
    (the row length overstates them); MFU divides by the device peak."""
    cfg = DSV4Config.preset("tiny", sliding_window=2048, head_dim=64, num_attention_heads=8)
    batch = _two_document_row([1000, 1000], 2048)
    stats = step_stats_from(batch_statistics(batch, cfg.shard_multiple, document_flops(cfg)), step=1, cp=2, dp=1,
                            world_size=2, step_time_s=0.5)
    per_document = 2 * document_training_flops(cfg, 1000)
    assert stats.model_flops == pytest.approx(per_document)
    assert stats.real_tokens * training_flops_per_token(cfg, 2048) > 1.2 * per_document  # what a row-length count gives
    assert (stats.pack_padding, stats.alignment_padding) == (2048 - 2 * 1024, 2 * 24)
    cb = ThroughputCallback(window=4, warmup_steps=0, peak_flops=2e9)
    got = run(cb, FakeModule(), stats)
    assert got["perf/tflops_per_device"] == pytest.approx(per_document / 2 / 0.5 / 1e12)
    assert got["perf/mfu"] == pytest.approx(per_document / 2 / 0.5 / 2e9)


def test_throughput_without_flops_or_peak():
    got = run(ThroughputCallback(warmup_steps=0), FakeModule(), make_stats(1))
    assert "perf/tflops_per_device" not in got and "perf/mfu" not in got
    got = run(ThroughputCallback(warmup_steps=0), FakeModule(), make_stats(1, flops=1e12))  # "auto" peak on CPU
    assert "perf/tflops_per_device" in got and "perf/mfu" not in got


@pytest.mark.parametrize("warmup, window", [(1, 2), (3, 2), (3, 10)])
def test_throughput_never_includes_a_warmup_step(warmup, window):
    """The first ``warmup`` steps (slow: allocator, caches) are excluded from every logged value."""
    cb = ThroughputCallback(window=window, warmup_steps=warmup, peak_flops=None)
    module = FakeModule()
    for step in range(1, warmup + 1):
        assert run(cb, module, make_stats(step, real=1000, time_s=100.0)) == {}
    for step in range(warmup + 1, warmup + 6):
        got = run(cb, module, make_stats(step, real=1000, time_s=1.0))
        assert got["perf/tokens_per_s"] == pytest.approx(1000.0) and got["perf/step_time_s"] == pytest.approx(1.0)


def test_throughput_rejects_bad_arguments():
    with pytest.raises(ValueError, match="window"):
        ThroughputCallback(window=0)
    with pytest.raises(ValueError, match="peak_flops"):
        ThroughputCallback(peak_flops="H100")


# ------------------------------------------------------------------------------------------------ padding
def test_padding_fractions_per_step_and_cumulative():
    cb = PaddingCallback()
    module = FakeModule()
    assert run(cb, module) == {}
    got = run(cb, module, make_stats(1, rows=2, seq_len=500, real=850, label=800, pack=100, align=50))
    assert got == pytest.approx({
        "data/padding_fraction": 0.15,
        "data/pack_padding_fraction": 0.10,
        "data/alignment_padding_fraction": 0.05,
        "data/padding_fraction_cumulative": 0.15,
        "data/pack_padding_fraction_cumulative": 0.10,
        "data/alignment_padding_fraction_cumulative": 0.05,
        "data/tokens_per_step": 850.0,
        "data/label_tokens_per_step": 800.0,
    })
    assert run(cb, module) == {}  # same step: nothing new
    got = run(cb, module, make_stats(2, rows=2, seq_len=500, real=750, pack=0, align=250))
    assert got["data/padding_fraction"] == pytest.approx(0.25)
    assert got["data/pack_padding_fraction"] == 0.0
    assert got["data/alignment_padding_fraction"] == pytest.approx(0.25)
    assert got["data/padding_fraction_cumulative"] == pytest.approx(400 / 2000)
    assert got["data/pack_padding_fraction_cumulative"] == pytest.approx(100 / 2000)
    assert got["data/alignment_padding_fraction_cumulative"] == pytest.approx(300 / 2000)

    resumed = PaddingCallback()
    resumed.load_state_dict(cb.state_dict())
    got = run(resumed, module, make_stats(3, rows=2, seq_len=500, real=1000))
    assert got["data/padding_fraction"] == 0.0
    assert got["data/padding_fraction_cumulative"] == pytest.approx(400 / 3000)


# ------------------------------------------------------------------------------------------------ CP traffic
TRAFFIC = {
    "halo": {"calls": 2, "bytes_sent": 100, "bytes_received": 60},
    "compressed_gather": {"calls": 1, "bytes_sent": 40, "bytes_received": 400},
}


def test_cp_traffic_local_values():
    cb = CPTrafficCallback(reduce="local")
    module = FakeModule()
    assert run(cb, module) == {}
    got = run(cb, module, make_stats(1, traffic=TRAFFIC))
    assert got == {
        "cp/bytes_received_per_step": 460.0,
        "cp/bytes_sent_per_step": 140.0,
        "cp/halo_bytes": 60.0,
        "cp/compressed_gather_bytes": 400.0,
    }
    assert run(cb, module) == {}
    # cp = 1: no exchanges, zeros (the default "max" is the identity without a process group)
    got = run(CPTrafficCallback(), module, make_stats(2, cp=1, world=1))
    assert got == {"cp/bytes_received_per_step": 0.0, "cp/bytes_sent_per_step": 0.0}
    with pytest.raises(ValueError, match="reduce"):
        CPTrafficCallback(reduce="mean")


_RANK_TRAFFIC = [
    {"compressed_gather": {"calls": 1, "bytes_sent": 10, "bytes_received": 400}},
    {"halo": {"calls": 2, "bytes_sent": 5, "bytes_received": 60},
     "compressed_gather": {"calls": 1, "bytes_sent": 30, "bytes_received": 100}},
]


def test_cp_traffic_max_over_ranks(monkeypatch):
    """Two ranks simulated by a fake all_gather_object: per-key max, a kind missing on a rank counts 0."""
    import dsv4.callbacks.cp_traffic as cp_traffic
    from dsv4.callbacks.cp_traffic import traffic_metrics

    other_rank = traffic_metrics(_RANK_TRAFFIC[1])
    calls = []

    def all_gather_object(out, obj):
        calls.append(obj)
        out[0], out[1] = obj, other_rank

    monkeypatch.setattr(cp_traffic.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(cp_traffic.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(cp_traffic.dist, "all_gather_object", all_gather_object)
    module = FakeModule()
    got = run(CPTrafficCallback(), module, make_stats(1, traffic=_RANK_TRAFFIC[0], world=2, cp=2))
    assert got == {
        "cp/bytes_received_per_step": 400.0,  # rank 0: 400, rank 1: 160
        "cp/bytes_sent_per_step": 35.0,
        "cp/compressed_gather_bytes": 400.0,
        "cp/halo_bytes": 60.0,  # only rank 1 receives a halo
    }
    assert len(calls) == 1  # one collective per step
    assert run(CPTrafficCallback(reduce="local"), module, make_stats(2, traffic=_RANK_TRAFFIC[0])) == {
        "cp/bytes_received_per_step": 400.0, "cp/bytes_sent_per_step": 10.0, "cp/compressed_gather_bytes": 400.0,
    }
    assert len(calls) == 1  # "local" never communicates


# ------------------------------------------------------------------------------------------------ memory
def test_memory_on_cpu_logs_positive_rss():
    module = FakeModule()
    got = run(MemoryCallback(), module)  # needs no stats
    assert set(got) == {"mem/rss_gib", "mem/peak_rss_gib"}
    assert 0 < got["mem/rss_gib"] <= got["mem/peak_rss_gib"] < 1024
    assert run(MemoryCallback(), module, make_stats(1))["mem/rss_gib"] > 0


# ------------------------------------------------------------------------------------------------ Trainer smoke
def test_callbacks_under_a_real_trainer(tmp_path):
    """The log keyword arguments are accepted by Lightning from on_train_batch_end; tokens/s reaches the bar."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)
            self.last_step_stats = None

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch[0]).pow(2).mean()
            self.log("train/loss", loss, prog_bar=True)
            self.last_step_stats = make_stats(
                batch_idx + 1, time_s=0.25, world=1, cp=1, pack=64, align=32, traffic=TRAFFIC
            )
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=CSVLogger(tmp_path), enable_checkpointing=False,
        enable_model_summary=False, default_root_dir=tmp_path, log_every_n_steps=1,
        callbacks=[ThroughputCallback(warmup_steps=1), PaddingCallback(), CPTrafficCallback(), MemoryCallback()],
    )
    trainer.fit(Module(), data)
    metrics = trainer.callback_metrics
    assert metrics["perf/tokens_per_s"].item() == pytest.approx(4000.0)
    assert metrics["data/padding_fraction"].item() == pytest.approx(96 / 1024)
    assert metrics["cp/halo_bytes"].item() == 60.0
    assert metrics["mem/rss_gib"].item() > 0
    assert "perf/tokens_per_s" in trainer.progress_bar_metrics
    assert "train/loss" in trainer.progress_bar_metrics
    header = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"perf/tokens_per_s", "data/pack_padding_fraction", "cp/bytes_received_per_step"} <= set(header)


# ------------------------------------------------------------------------------------------------ text progress
class FakeTrainer:
    def __init__(self, max_steps=100, global_step=0, rank_zero=True):
        self.max_steps, self.global_step, self.is_global_zero = max_steps, global_step, rank_zero
        self.callback_metrics = {}


def _end(callback, trainer, module, stats=None):
    if stats is not None:
        module.last_step_stats = stats
    callback.on_train_batch_end(trainer, module, None, None, 0)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_text_progress_line_every_n_steps_and_at_the_last(caplog):
    from dsv4.callbacks import TextProgressCallback

    caplog.set_level("INFO", logger="dsv4")
    clock = FakeClock()
    cb = TextProgressCallback(every_n_steps=2, when="always", clock=clock)
    trainer, module = FakeTrainer(max_steps=5), FakeModule()
    cb.on_train_start(trainer, module)
    lines = []
    for step, (real, seconds, loss, lr) in enumerate([(1000, 2.0, 5.5, 1e-3), (3000, 2.0, 4.25, 2e-3),
                                                      (500, 1.0, 4.0, 3e-3), (700, 1.0, 3.5, 4e-3),
                                                      (800, 2.0, 3.25, 5e-3)], start=1):
        clock.now += 10.0  # 10 s of wall time per step
        trainer.callback_metrics = {"train/loss": torch.tensor(loss), "train/lr": torch.tensor(lr)}
        caplog.clear()
        _end(cb, trainer, module, make_stats(step, real=real, time_s=seconds))
        _end(cb, trainer, module)  # the same step again (another micro-batch's end): nothing
        lines += [r.getMessage() for r in caplog.records]
    # steps 2 and 4 (every 2) and 5 (the last); tokens/s over the steps since the previous line; ETA: 10 s per step
    assert lines == [
        "step 2/5 | loss 4.2500 | lr 2.000e-03 | 1,000 tokens/s | ETA 0:00:30",
        "step 4/5 | loss 3.5000 | lr 4.000e-03 | 600 tokens/s | ETA 0:00:10",
        "step 5/5 | loss 3.2500 | lr 5.000e-03 | 400 tokens/s | ETA 0:00:00",
    ]


def test_text_progress_auto_follows_the_terminal_and_only_rank_zero_writes(caplog, monkeypatch):
    from dsv4.callbacks import TextProgressCallback

    caplog.set_level("INFO", logger="dsv4")
    cb = TextProgressCallback(every_n_steps=1, when="auto")
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert not cb.enabled  # a terminal: the progress bar shows
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    assert cb.enabled
    cb.on_train_start(FakeTrainer(), FakeModule())
    _end(cb, FakeTrainer(), FakeModule(), make_stats(1))
    assert any(r.getMessage().startswith("step 1/100") for r in caplog.records)
    caplog.clear()
    other = TextProgressCallback(every_n_steps=1, when="always")
    trainer = FakeTrainer(rank_zero=False)
    other.on_train_start(trainer, FakeModule())
    _end(other, trainer, FakeModule(), make_stats(1))
    assert not caplog.records
    with pytest.raises(ValueError, match="every_n_steps must be an integer >= 1, got 0"):
        TextProgressCallback(every_n_steps=0)
    with pytest.raises(ValueError, match="when='sometimes' must be one of auto, always, never"):
        TextProgressCallback(when="sometimes")
