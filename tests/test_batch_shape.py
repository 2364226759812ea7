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
        "equally; resume with 1, 2, 4, 8 processes"
    )


def test_a_resume_as_saved_keeps_the_flags_and_says_nothing():
    cfg = replace(TrainConfig(), per_device_train_batch_size=4, gradient_accumulation_steps=2)
    record = CheckpointRecord("r", "no", 2, TrainState(samples_in_epoch=32), data={"global_batch_size": 16})
    assert keep_global_batch(cfg, record, 2) == (cfg, [])


NOTE = (
    "note: the checkpoint was saved by {saved_by} with 8 examples per optimizer step; this run keeps them: "
    "1 process x {per_device} per device x {accumulated} accumulated, and continues at example 32 of epoch 0, so "
    "the steps and their LR are the uninterrupted run's and, on the same training data, no example is trained twice "
    "or skipped; dropout and rounding differ from it"
)
ANOTHER_BATCH = (
    " (the flags asked for {0} per device x {1} accumulated: a resume keeps the run's examples per step; a new run "
    "can change them)"
)


@pytest.mark.parametrize(
    "saved_by, flags_before, flags, kept, said",
    [
        # 2 processes x 4 resumed on 1 as 4 x 2, which saved: the same flags on 1 process again train as it did.
        (1, [4, 1], (4, 1), (4, 2), None),
        (1, [4, 1], (4, 2), (4, 2), None),  # the shape it trained, given as flags
        (2, [4, 1], (4, 1), (4, 2), NOTE),  # the first resume on 1 process: the flags were the run's
        (2, [4, 1], (8, 1), (8, 1), NOTE),  # flags that make the global batch on this process count
        (1, [4, 1], (2, 1), (2, 4), NOTE + ANOTHER_BATCH),  # another batch asked for: not given
        (1, [4, 1], (4, 4), (4, 2), NOTE + ANOTHER_BATCH),
        (1, None, (4, 1), (4, 2), NOTE + ANOTHER_BATCH),  # no flags recorded: those of the saving run's shape
        (2, None, (4, 1), (4, 2), NOTE),
    ],
)
def test_a_resume_says_what_it_keeps_and_that_the_flags_asked_for_another_batch_only_where_they_did(
    saved_by, flags_before, flags, kept, said
):
    # The second resume on one process of a two-process run said that its flags, the run's own, asked for another
    # batch: they were compared with the shape that the first resume trained, not with what its command gave.
    cfg = replace(TrainConfig(), per_device_train_batch_size=flags[0], gradient_accumulation_steps=flags[1])
    state = TrainState(samples_in_epoch=32)
    record = CheckpointRecord("r", "no", saved_by, state, data={"global_batch_size": 8}, batch_flags=flags_before)
    resumed, notes = keep_global_batch(cfg, record, 1)
    assert (resumed.per_device_train_batch_size, resumed.gradient_accumulation_steps) == kept
    expected = said and said.format(
        *flags, saved_by={1: "1 process", 2: "2 processes"}[saved_by], per_device=kept[0], accumulated=kept[1]
    )
    assert notes == ([expected] if said else [])


UNEVEN_FILLS = {  # what fills the last micro-step: the epoch's first examples, or repeats of all where it has fewer
    (30, 4, 2): "the epoch's first 2 examples again",
    (31, 2, 3): "the epoch's first 5 examples again",
    (8, 4, 2): None,
    (5, 4, 3): "7 repeats of the epoch's 5 examples",
    (1, 2, 2): "3 repeats of the epoch's 1 example",
    (3, 1, 2): "the epoch's first example again",
}


@pytest.mark.parametrize("examples, per_device, processes", list(UNEVEN_FILLS))
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
            f"note: with {examples} {'training example' if examples == 1 else 'training examples'}, each epoch's last "
            f"micro-step is {repeated} short on {processes} processes x {per_device}: Accelerate fills it with "
            f"{UNEVEN_FILLS[examples, per_device, processes]}, trained "
            f"{'twice' if most == 2 else 'two or more times'} in that epoch (as under HF Trainer); a multiple of "
            f"{per_device * processes} examples would not"
        ]
        assert sorted(set(trained)) == list(range(examples))
        if most == 2:
            assert sorted(trained)[: 2 * repeated : 2] == list(range(repeated)), "the first examples are repeated"
    assert uneven_epoch_note(30, 8, 1) == [], "one process is not sharded: its last batch is short, not filled"
