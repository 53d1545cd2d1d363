"""Capture DSpark target features: a frozen DSV4 target over a dataset, packed, written as safetensors shards.

    python recipes/capture_dspark.py                                  # tiny model, bundled corpus, 1 CPU rank
    python recipes/capture_dspark.py dp=2 model=v4_ratio2_tiny layer_ids='[1,2,3]'
    python recipes/capture_dspark.py output_dir=/data/feats model.checkpoint=/ckpt/DeepSeek-V4-Flash data=jsonl ...

Re-running with the same config resumes: finished shards are skipped (see dsv4/speculative/capture_job.py).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from dsv4.training.schema import register_schema

register_schema()


@hydra.main(version_base="1.3", config_path="../conf", config_name="capture_dspark")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from dsv4.speculative.capture_job import run_capture

    run_capture(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
