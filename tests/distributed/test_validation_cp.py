"""``val/loss`` under context parallelism: CP 2 (and CP 2 x DP 2) on gloo equal one process evaluating the same
held-out rows, which equals the model's own token mean over them (fp32, tiny preset).

Five packed rows (documents crossing the CP cut, an odd row count so a DP rank evaluates a filler row without
labels); every rank builds the same model and evaluates its dp share (:class:`ValidationShard`) of its CP slice;
the (CE sum, label count) pair is reduced once over all ranks.
"""

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed

MICRO = 2


def _model():
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(0)
    return DSV4ForCausalLM(DSV4Config.preset("tiny")).eval()


def _rows():
    from dsv4.data import build_packed_dataset

    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(1, 256, (int(n),), generator=g).tolist() for n in (300, 200, 180, 150, 120, 230, 90, 140, 450)]
    rows = build_packed_dataset(docs, 512, 128, cp_size=2)
    assert len(rows) == 5
    return rows


def _loader(rows, dp_rank, dp_size):
    from torch.utils.data import DataLoader

    from dsv4.batch import TokenBatch
    from dsv4.data.validation import ValidationShard

    return DataLoader(ValidationShard(rows, dp_rank, dp_size, MICRO), batch_size=MICRO, collate_fn=TokenBatch.stack)


def _body(rank, world_size):
    from dsv4.parallel.cp import CPContext
    from dsv4.training.strategy import ParallelState
    from dsv4.training.validation import evaluate_token_loss

    cp = 2
    groups = [dist.new_group(list(range(start, start + cp))) for start in range(0, world_size, cp)]
    dp_rank, dp_size = rank // cp, world_size // cp
    parallel = ParallelState(cp=CPContext(groups[dp_rank]), cp_rank=rank % cp, cp_size=cp, dp_size=dp_size,
                             loss_group=dist.group.WORLD)
    model = _model()
    return evaluate_token_loss(model, _loader(_rows(), dp_rank, dp_size), parallel, model.config.shard_multiple,
                               "cpu")


def _one_process():
    from dsv4.training.strategy import ParallelState
    from dsv4.training.validation import evaluate_token_loss

    model, rows = _model(), _rows()
    evaluated = evaluate_token_loss(model, _loader(rows, 0, 1), ParallelState(), model.config.shard_multiple, "cpu")
    batch = rows.batch
    with torch.no_grad():
        out = model(batch.input_ids, position_ids=batch.positions, packed_seq_ids=batch.seq_ids,
                    padding_mask=batch.padding, labels=batch.labels, return_logits=False)
    return evaluated, (float(out.loss_sum) / int(out.label_count), int(out.label_count))


@pytest.mark.parametrize("world_size", [2, 4])  # cp 2 x dp 1, cp 2 x dp 2
def test_val_loss_under_cp_equals_one_process_and_the_direct_token_mean(world_size):
    (loss, tokens), (direct, direct_tokens) = _one_process()
    assert tokens == direct_tokens and loss == pytest.approx(direct, rel=1e-6)  # the hand check on one rank
    for rank_loss, rank_tokens in run_on_ranks(_body, world_size):
        assert rank_tokens == tokens
        assert abs(rank_loss - loss) <= 1e-5, (world_size, rank_loss, loss)
