"""A resume keeps the run's examples per optimizer step: the per-device batch and accumulation it takes for another
process count or --per_device_train_batch_size (end to end: tests/test_multiprocess.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.config import TrainConfig
from app.errors import UsageError
from app.inputs.batch_shape import keep_global_batch, resumed_shape
from app.state import TrainState
from app.storage.checkpoints import CheckpointRecord


@pytest.mark.parametrize(
    "global_batch, processes, most_per_device, shape",
    [
        (16, 2, 8, (8, 1)),  # as saved
        (16, 1, 8, (8, 2)),  # fewer processes: accumulate
        (8, 2, 8, (4, 1)),  # more processes: fewer per device
        (8, 1, 3, (2, 4)),  # a smaller batch per device than saved, not a divisor: the largest that divides
        (8, 1, 32, (8, 1)),  # a larger one: the global batch stays
        (14, 2, 4, (1, 7)),  # 7 per process, prime
    ],
)
def test_the_shape_of_a_resume_makes_the_checkpoints_global_batch(global_batch, processes, most_per_device, shape):
    assert resumed_shape(global_batch, processes, most_per_device) == shape


def test_a_process_count_that_cannot_share_the_global_batch_is_refused_naming_the_ones_that_can():
    with pytest.raises(UsageError) as refused:
        resumed_shape(8, 3, 8)
    assert str(refused.value) == (
        "--resume_from_checkpoint: the run trains 8 examples per optimizer step, which 3 processes cannot share "
        "equally; resume with 1, 2, 4, 8 process(es)"
    )


def test_a_resume_as_saved_keeps_the_flags_and_says_nothing():
    cfg = replace(TrainConfig(), per_device_train_batch_size=4, gradient_accumulation_steps=2)
    record = CheckpointRecord("r", "no", 2, TrainState(samples_in_epoch=32), data={"global_batch_size": 16})
    assert keep_global_batch(cfg, record, 2) == (cfg, [])


@pytest.mark.parametrize("examples, per_device, processes", [(30, 4, 2), (31, 2, 3), (8, 4, 2), (5, 4, 3)])
def test_the_repeats_that_fill_an_uneven_epoch_are_named_as_accelerate_makes_them(examples, per_device, processes):
    # 2 processes x 4 on 30 examples trained 0 and 1 twice per epoch (rank 1's last batch [28, 29, 0, 1]) without a
    # word, and did not match 1 process x 8. The count is Accelerate's own, from its batch sampler shards.
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from app.inputs.batch_shape import uneven_epoch_note

    shards = [
        list(BatchSamplerShard(BatchSampler(range(examples), per_device, False), processes, rank, even_batches=True))
        for rank in range(processes)
    ]
    trained = [i for shard in shards for batch in shard for i in batch]
    repeated = len(trained) - examples
    note = uneven_epoch_note(examples, per_device, processes)
    if repeated == 0:
        assert note == []
    else:
        most = max(trained.count(i) for i in range(examples))  # 5 examples on 3 x 4: some train 3 times, not twice
        assert note == [
            f"note: {examples} training examples leave each epoch's last micro-step {repeated} short on {processes} "
            f"processes x {per_device}: Accelerate fills it with {repeated} of the epoch's first examples, which "
            f"train {'twice' if most == 2 else 'two or more times'} in that epoch (as under HF Trainer); a multiple "
            f"of {per_device * processes} examples would not"
        ]
        assert sorted(set(trained)) == list(range(examples))
        if most == 2:
            assert sorted(trained)[: 2 * repeated : 2] == list(range(repeated)), "the first examples are repeated"
    assert uneven_epoch_note(30, 8, 1) == [], "one process is not sharded: its last batch is short, not filled"
