"""Fine-tune a DeepSeek-V4-family model with context parallelism.

    python recipes/finetune.py cp=4                      # tiny model, bundled corpus, 4 CPU processes
    python recipes/finetune.py model=flash cp=8 dp=4 dispatcher=alltoall ep=8 data=jsonl data.path=...
    python recipes/finetune.py -m cp=1,2                 # a sweep: one complete run per job
    python recipes/finetune.py --cfg job                 # print the composed config
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from dsv4.training.schema import register_schema

register_schema()


@hydra.main(version_base="1.3", config_path="../conf", config_name="finetune")
def main(cfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    from dsv4.training.run import run_finetune

    return run_finetune(cfg, HydraConfig.get().runtime.output_dir, script=__file__)


if __name__ == "__main__":
    main()
