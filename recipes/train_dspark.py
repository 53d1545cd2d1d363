"""Train a DeepSeek-V4.1 DSpark drafter against its frozen target (the fine-tuning framework's run, strategy,
checkpoints, resume, preemption, loggers and callbacks; docs/dspark.md).

    python recipes/train_dspark.py                                         # v41_tiny, bundled corpus, CPU
    python recipes/train_dspark.py model.checkpoint=/ckpt/V4.1 data=jsonl data.path=chat.jsonl data.val_fraction=0.02
    python recipes/train_dspark.py mode=offline features=outputs/capture/.../features
    python recipes/train_dspark.py drafter.init=random export.hf_dir=out/hf   # the drafter beside the target in out/hf
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from dsv4.training.schema import register_schema

register_schema()


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_dspark")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    from dsv4.training.dspark_run import TRAIN_DSPARK
    from dsv4.training.run import run_finetune

    return run_finetune(cfg, HydraConfig.get().runtime.output_dir, script=__file__, recipe=TRAIN_DSPARK)


if __name__ == "__main__":
    main()
