"""AdamW moments in less memory (``optim.state_dtype``) against the loss they reach: fp32, bf16 and 8-bit moments.

For each model and each ``optim.state_dtype`` the recipe trains ``--steps`` optimizer steps on one CPU process
(``cp=1``, the embedded standard-library data, ``seq_len`` ``--seq-len``, the default optimizer and schedule, the
same seed, so every run sees the same batches in the same order and starts from the same weights); ``train/loss`` is
read from the run's CSV log. Per model and option:

* ``optimizer_state.final_loss``: mean ``train/loss`` over the last ``--window`` steps;
* ``optimizer_state.final_gap``: that minus the fp32 moments' (positive: the cheaper state ends higher);
* ``optimizer_state.max_abs_gap``: the largest ``|loss - fp32 loss|`` at any one step.

With ``--plot-dir`` it writes ``optimizer_state_<model>.svg`` there (:func:`plot_losses`, matplotlib: ``pip install
-e '.[bench]'``): the loss curves (a moving average over ``--window`` steps) of every option. Models: ``tiny``
(``conf/model/tiny.yaml``) and ``mid`` (``MODELS`` of ``benchmarks/memory_plan.py``: hidden 512, 8 layers, 16
experts, vocabulary 32768).

    python benchmarks/optimizer_state.py --plot-dir docs/images                  # tiny and mid, 300 steps
    python benchmarks/optimizer_state.py --models tiny --steps 20 --state-dtypes float32 bfloat16   # a quick look

With ``--work-dir`` the runs are kept there, and a run whose log already holds every step is read, not repeated
(so an interrupted benchmark resumes with the runs it had finished).
"""

from __future__ import annotations

import argparse
import csv
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from common import emit
from memory_plan import MODELS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

REPO = Path(__file__).resolve().parents[1]
STATE_DTYPES = ("float32", "bfloat16", "8bit")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _override(value) -> str:
    """A Hydra command-line value: lists as ``[a,b]``."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def model_overrides(model: str) -> list[str]:
    """``model=tiny`` plus the field overrides that make ``model`` (``MODELS``)."""
    if model not in MODELS:
        raise ValueError(f"--models: unknown model {model!r}; known: {sorted(MODELS)}")
    return ["model=tiny", *(f"model.{k}={_override(v)}" for k, v in MODELS[model].items())]


def train_losses(model: str, state_dtype: str, steps: int, seq_len: int, work: Path) -> dict[int, float]:
    """Run the recipe for ``steps`` steps with ``optim.state_dtype=state_dtype``; ``{step: train/loss}``."""
    run_dir = work / f"{model}-{state_dtype}-{steps}steps-seq{seq_len}"
    done = _read_losses(run_dir) if (run_dir / "csv" / "metrics.csv").exists() else {}
    if sorted(done) == list(range(steps)):
        return done
    cmd = [sys.executable, str(REPO / "recipes" / "finetune.py"), *model_overrides(model), "cp=1",
           f"seq_len={seq_len}", f"trainer.max_steps={steps}", "logger=csv", "checkpoint.every_n_steps=0",
           "plan.enabled=false", f"data.cache_dir={work / 'data-cache'}", f"optim.state_dtype={state_dtype}",
           f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "WANDB_MODE": "offline", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    out = _read_losses(run_dir)
    if sorted(out) != list(range(steps)):
        raise RuntimeError(f"{run_dir}: expected train/loss at steps 0..{steps - 1}, got {len(out)} steps")
    return out


def _read_losses(run_dir: Path) -> dict[int, float]:
    """``{step: train/loss}`` of a run's CSV log."""
    out: dict[int, float] = {}
    with open(run_dir / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            if row.get("train/loss"):
                out[int(row["step"])] = float(row["train/loss"])
    return out


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each position (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _matplotlib():
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(f"--plot-dir needs matplotlib: pip install -e '.[bench]' ({err})") from None
    return matplotlib


def plot_losses(curves: dict[str, list[float]], window: int, path: Path, title: str) -> Figure:
    """Write the SVG line chart of ``curves`` (label -> the loss at steps 0, 1, ...) to ``path``: one line per
    curve, its ``window``-step :func:`moving_average` against the optimizer step, with a legend. Text stays text
    (``svg.fonttype`` none) and the file carries no date, so the same curves give the same file. Returns the
    matplotlib ``Figure``."""
    matplotlib = _matplotlib()
    from matplotlib.figure import Figure

    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "dsv4-benchmarks"}):
        fig = Figure(figsize=(7.2, 4.2))
        ax = fig.add_subplot()
        for label, values in curves.items():
            ax.plot(range(len(values)), moving_average(values, window), label=label, linewidth=1.5, alpha=0.85)
        ax.set(title=title, xlabel="optimizer step", ylabel="train/loss")
        ax.grid(True, color="#dddddd")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="svg", metadata={"Date": None})
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "mid"])
    parser.add_argument("--state-dtypes", nargs="+", default=list(STATE_DTYPES), choices=STATE_DTYPES)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--window", type=int, default=20, help="steps averaged for the final loss and the plot")
    parser.add_argument("--plot-dir", type=Path, default=None)
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the runs here and reuse finished ones")
    args = parser.parse_args()
    if "float32" not in args.state_dtypes:
        raise ValueError("--state-dtypes must include float32: the gaps are measured against it")
    if not 1 <= args.window <= args.steps:
        raise ValueError(f"--window={args.window} must be between 1 and --steps={args.steps}")
    if args.plot_dir is not None:
        _matplotlib()  # before any run
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        for model in args.models:
            curves = {dt: train_losses(model, dt, args.steps, args.seq_len, work) for dt in args.state_dtypes}
            reference = [curves["float32"][s] for s in range(args.steps)]
            final_ref = sum(reference[-args.window:]) / args.window
            for dt, losses in curves.items():
                values = [losses[s] for s in range(args.steps)]
                shape = {"model": model, "state_dtype": dt, "steps": args.steps, "seq_len": args.seq_len,
                         "window": args.window}
                final = sum(values[-args.window:]) / args.window
                emit("optimizer_state.final_loss", shape, round(final, 5), "loss")
                emit("optimizer_state.final_gap", shape, round(final - final_ref, 5), "loss")
                emit("optimizer_state.max_abs_gap", shape,
                     round(max(abs(a - b) for a, b in zip(values, reference)), 5), "loss")
            if args.plot_dir is not None:
                args.plot_dir.mkdir(parents=True, exist_ok=True)
                plot_losses({f"moments {dt}": [curves[dt][s] for s in range(args.steps)] for dt in args.state_dtypes},
                            args.window, args.plot_dir / f"optimizer_state_{model}.svg",
                            f"{model} model: train/loss by AdamW moment precision ({args.window}-step moving average)")


if __name__ == "__main__":
    main()
