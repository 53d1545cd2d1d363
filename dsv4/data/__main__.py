"""``python -m dsv4.data prepare [overrides]``: tokenize and pack a run's data once, into ``data.cache_dir``.

The overrides are those of ``recipes/finetune.py`` (the same Hydra config is composed, ``conf/finetune.yaml``, and
resolved by :func:`dsv4.training.spec.build_run_spec`), so ``python -m dsv4.data prepare data=jsonl
data.path=train.jsonl seq_len=8192 model.checkpoint=/ckpt`` prepares exactly the dataset that the recipe with
the same overrides maps at start-up (held-out data too). Prints the packing line and the directory of the training
rows, then of the held-out rows; exit status 2 on bad arguments.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

USAGE = "usage: python -m dsv4.data prepare [finetune overrides, e.g. data=jsonl data.path=train.jsonl seq_len=8192]"


def compose_finetune(overrides: list[str]):
    """The composed ``conf/finetune.yaml`` with ``overrides`` (as the recipe composes it)."""
    from hydra import compose, initialize_config_dir

    from dsv4.training.schema import register_schema

    register_schema()
    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return compose(config_name="finetune", overrides=overrides)


def prepare(overrides: list[str]):
    """Prepare (or find) the data of a fine-tune with ``overrides``: the training rows and, with ``data.val_fraction``
    or ``data.val``, the held-out rows (as the recipe's data module prepares them). Returns ``(training rows,
    held-out rows or None)``, :class:`~dsv4.data.prepared.PreparedRows`."""
    from dsv4.data.datamodule import DSV4DataModule
    from dsv4.training.spec import build_run_spec

    spec = build_run_spec(compose_finetune(overrides))
    if spec.data_cache_dir is None:
        raise ValueError("`data.cache_dir` is null: there is nowhere to prepare the dataset; set data.cache_dir=DIR")
    data = DSV4DataModule.from_spec(spec)
    return data.build_dataset(), data.build_val_dataset()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "prepare":
        print(USAGE, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows, val_rows = prepare(argv[1:])
    print(rows.stats.summary())
    print(rows.path)
    if val_rows is not None:
        print(f"validation {val_rows.stats.summary()}")
        print(val_rows.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
