"""2-rank expert-parallel checkpoint load: each rank reads only its own experts' keys (counted per rank).

The parent writes a synthetic release-format checkpoint (FP8 / FP4 tensors with known values, 3 shards). Each gloo
rank builds the tiny model, EP-shards it over the default group (``shard_experts``), loads the checkpoint and
returns the on-disk keys it read plus its expert weights. Asserted: rank r read exactly the expert keys of
experts [4r, 4r + 4) (weights and scales, backbone and MTP) plus every non-expert key, and its expert slices
equal the known dequantised values.
"""

import pytest
import torch

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed


def _load_rank(rank, world_size, path):
    from dsv4.checkpoint import load_hf_checkpoint
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from dsv4.parallel.expert_shard import shard_experts

    torch.manual_seed(5)
    model = DSV4ForCausalLM(DSV4Config.preset("tiny"))
    shard_experts(model)  # default group: rank r keeps experts [4r, 4r + 4)
    report = load_hf_checkpoint(model, path)
    experts = {k: v.clone() for k, v in model.state_dict().items() if ".mlp.experts." in k}
    return {"keys_read": list(report.keys_read), "experts": experts}


def test_two_rank_ep_load_reads_only_own_experts(tmp_path):
    from dsv4.checkpoint import CheckpointDir
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from tests.unit.checkpoint.helpers import synthetic_release_checkpoint

    path = str(tmp_path)
    expected = synthetic_release_checkpoint(DSV4ForCausalLM(DSV4Config.preset("tiny")), path, num_shards=3)
    all_keys = set(CheckpointDir.open(path).tensors)
    non_expert = {k for k in all_keys if ".experts." not in k}
    results = run_on_ranks(_load_rank, 2, (path,))
    for rank, res in enumerate(results):
        read = res["keys_read"]
        assert len(read) == len(set(read))  # nothing read twice
        experts_read = {k for k in read if ".experts." in k}
        own = {k for k in all_keys if ".experts." in k and 4 * rank <= int(k.split(".experts.")[1].split(".")[0]) < 4 * rank + 4}
        assert experts_read == own
        assert len(experts_read) == 5 * 4 * 3 * 2  # 4 layers + MTP, 4 experts, w1/w3/w2, weight + scale
        assert set(read) - experts_read == non_expert
        w2 = res["experts"]["model.layers.2.mlp.experts.w2"]
        assert w2.shape[0] == 4
        for row in range(4):
            assert torch.equal(w2[row], expected[f"layers.2.ffn.experts.{4 * rank + row}.w2.weight"])
