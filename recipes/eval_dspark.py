"""DSpark speculative decoding that measures real acceptance: a V4.1 target verifies what its drafter proposes.

    python recipes/eval_dspark.py                                                # tiny V4.1, a fresh drafter, CPU
    python recipes/eval_dspark.py model.checkpoint=/ckpt/DeepSeek-V4.1-Flash drafter.checkpoint=/ckpt/DeepSeek-V4.1-Flash \
        data=jsonl data.path=gsm8k.jsonl num_prompts=64 max_new_tokens=256
    python recipes/eval_dspark.py temperature=1.0                                # speculative rejection sampling

The last stdout line is one JSON object: acceptance_length, acceptance_per_position, the confidence calibration, ...
(see dsv4/speculative/eval_job.py and docs/dspark.md).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from dsv4.training.schema import register_schema

register_schema()


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval_dspark")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from dsv4.speculative.eval_job import run_eval

    run_eval(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
