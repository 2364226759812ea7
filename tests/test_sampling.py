"""Batch orders: length-grouped training batches through Accelerate's real wrappers, and evaluation in length order."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from accelerate import skip_first_batches
from accelerate.data_loader import SeedableRandomSampler, get_sampler, prepare_data_loader
from datasets import Dataset, DatasetDict
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, DataCollatorWithPadding

from app.config import TrainConfig
from app.inputs.data import make_loaders
from app.inputs.sampling import DataPosition, LengthGroupedSampler, length_order, recorded_in_examples, token_counts
from app.state import TrainState
from app.storage.checkpoints import CheckpointRecord
from tests.harness import build_training

SEED, BATCH = 5, 16


def mixed_lengths(n: int) -> list[int]:
    """Lengths spread evenly over 2..128 tokens, in random order: a worst case for padding in random batches."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(2, 129, (n,), generator=generator).tolist()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def loader_for(tokenizer, lengths: list[int], strategy: str = "group_by_length", num_processes: int = 1):
    """The app's training loader over examples of these lengths, whose label is their index (to trace them)."""
    split = Dataset.from_dict({"input_ids": [[5] * n for n in lengths], "labels": list(range(len(lengths)))})
    cfg = replace(TrainConfig(), per_device_train_batch_size=BATCH, seed=SEED, train_sampling_strategy=strategy)
    collate = DataCollatorWithPadding(tokenizer)
    train_loader, _ = make_loaders(DatasetDict(train=split, validation=split), collate, cfg, num_processes)
    return train_loader


def shard(loader, num_processes: int, rank: int):
    """The loader as `accelerator.prepare` hands it to one rank (with runtime.build_accelerator's flags)."""
    return prepare_data_loader(
        loader,
        num_processes=num_processes,
        process_index=rank,
        put_on_device=False,
        use_seedable_sampler=True,
        data_seed=SEED,
    )


def epoch_batches(loader, epoch: int, skip: int = 0) -> list[list[int]]:
    loader.set_epoch(epoch)
    batches = skip_first_batches(loader, skip) if skip else loader
    return [batch["labels"].tolist() for batch in batches]


def test_the_order_is_a_permutation_fixed_by_seed_and_epoch():
    lengths = mixed_lengths(1000)
    sampler = LengthGroupedSampler(lengths, BATCH, SEED)
    first, again = sampler.order(0), LengthGroupedSampler(lengths, BATCH, SEED).order(0)
    assert torch.equal(first, again)
    assert sorted(first.tolist()) == list(range(1000))
    assert not torch.equal(first, sampler.order(1)), "each epoch is shuffled anew"
    assert not torch.equal(first, LengthGroupedSampler(lengths, BATCH, SEED + 1).order(0))
    assert torch.equal(sampler.order(1), sampler.order(1)), "a pure function: no state carried between calls"


def test_set_epoch_and_skip_first_batches_reach_the_sampler_through_accelerate(tokenizer):
    lengths = mixed_lengths(300)
    for num_processes in (1, 2):
        train_loader = loader_for(tokenizer, lengths, num_processes=num_processes)
        for loader in (shard(train_loader, num_processes, rank) for rank in range(num_processes)):
            epoch0, epoch1 = epoch_batches(loader, 0), epoch_batches(loader, 1)
            assert epoch0 != epoch1, "set_epoch must reach the sampler"
            assert epoch_batches(loader, 0) == epoch0
            # A resume: set the epoch, then skip what was consumed; the rest of that very epoch follows.
            assert epoch_batches(loader, 1, skip=3) == epoch1[3:]


def test_two_ranks_get_disjoint_covering_shards_of_similar_lengths(tokenizer):
    lengths = mixed_lengths(1600)  # 50 steps of 2 x 16: no remainder to pad out
    loader = loader_for(tokenizer, lengths, num_processes=2)
    ranks = [epoch_batches(shard(loader, 2, r), epoch=1) for r in (0, 1)]
    seen = [i for batches in ranks for batch in batches for i in batch]
    assert sorted(seen) == list(range(1600)), "every example once, on one rank"
    longest = [[max(lengths[i] for i in batch) for batch in batches] for batches in ranks]
    assert len(longest[0]) == len(longest[1])
    # At each step the two ranks' longest examples are neighbours in a sorted mega-batch of 1,600 / 50 lengths.
    worst_gap = max(abs(a - b) for a, b in zip(*longest))
    assert worst_gap <= 8, worst_gap


def steps(loader, num_processes: int, epoch: int, skip: int = 0) -> list[list[int]]:
    """The examples of each optimizer step, over all ranks, in rank order, as `accelerator.prepare` cuts them."""
    ranks = [epoch_batches(shard(loader, num_processes, r), epoch, skip) for r in range(num_processes)]
    return [[i for batch in step for i in batch] for step in zip(*ranks)]


def test_the_random_order_is_the_one_accelerates_seedable_sampler_gave(tokenizer):
    """Runs and checkpoints of the random strategy from before the app had its own sampler go on in the same order."""
    loader = loader_for(tokenizer, mixed_lengths(100), "random")
    accelerates = SeedableRandomSampler(range(100), generator=torch.Generator(), data_seed=SEED)
    for epoch in (0, 3):
        accelerates.set_epoch(epoch)
        assert get_sampler(loader).order(epoch).tolist() == list(accelerates)


def resumed(tokenizer, lengths, strategy, state: TrainState, processes: int, saved_by: int, saved: dict | None):
    """A new process's loader, from the same config, set where the checkpoint says (DataPosition.resume), and the
    counters it resumed with."""
    loader = loader_for(tokenizer, lengths, strategy, processes)
    position = DataPosition(loader, BATCH, processes, accumulation=1)
    cfg = replace(TrainConfig(), per_device_train_batch_size=BATCH, train_sampling_strategy=strategy)
    record = recorded_in_examples(CheckpointRecord("r", "no", saved_by, state, data=saved), cfg, {})
    resumed_state = replace(record.state)
    assert not position.resume(resumed_state, record), "the run's own order: nothing to note"
    return loader, resumed_state


@pytest.mark.parametrize("strategy", ["group_by_length", "random"])
@pytest.mark.parametrize("saved_by, resumed_by, steps_done", [(1, 2, 3), (2, 1, 2), (1, 2, 4)])
def test_a_resume_with_another_process_count_continues_in_the_same_order_at_the_same_example(
    tokenizer, strategy, saved_by, resumed_by, steps_done
):
    lengths = mixed_lengths(16 * 22)  # 22 batches: whole steps for 1 and 2 processes
    saving = loader_for(tokenizer, lengths, strategy, saved_by)
    saved = DataPosition(saving, BATCH, saved_by, accumulation=1)
    state = TrainState(epoch=1, batches_in_epoch=steps_done)
    state.samples_in_epoch = saved.samples(state)
    trained = sum(steps(saving, saved_by, epoch=1)[:steps_done], [])
    assert state.samples_in_epoch == len(trained) == steps_done * saved_by * BATCH

    resuming, state = resumed(tokenizer, lengths, strategy, state, resumed_by, saved_by, saved.record())
    assert get_sampler(resuming).order(1).tolist() == get_sampler(saving).order(1).tolist(), "the run's own order"
    rest = sum(steps(resuming, resumed_by, epoch=1, skip=state.batches_in_epoch), [])
    untrained = get_sampler(resuming).order(1).tolist()[len(trained) :]
    assert rest[: len(untrained)] == untrained, "an example trained twice, or skipped"
    # Beyond: Accelerate's padding of an incomplete last step (even_batches), as at the end of any such epoch.
    assert len(rest) - len(untrained) < resumed_by * BATCH
    assert not get_sampler(resuming).skipped(2), "the next epoch starts at its first example"


def test_a_checkpoint_of_an_earlier_version_resumes_in_its_order_at_its_example(tokenizer):
    """No recorded position or order: the order was grouped by batch size x processes, the position is in batches."""
    lengths = mixed_lengths(16 * 22)
    state = TrainState(epoch=0, batches_in_epoch=3)  # 3 steps of 2 x 16 under the earlier app, 2 processes
    resuming, state = resumed(tokenizer, lengths, "group_by_length", state, 1, 2, None)
    order = loader_for(tokenizer, lengths, "group_by_length", 2).sampler.order(0)
    assert get_sampler(resuming).order(0).tolist() == order.tolist()
    assert sum(steps(resuming, 1, epoch=0, skip=state.batches_in_epoch), []) == order[3 * 2 * BATCH :].tolist()


def padding_fraction(loader, epoch: int = 0) -> float:
    loader.set_epoch(epoch)
    masks = [batch["attention_mask"] for batch in loader]
    return 1 - sum(m.sum().item() for m in masks) / sum(m.numel() for m in masks)


def test_grouped_batches_pad_little_on_mixed_lengths(tokenizer):
    lengths = mixed_lengths(4000)  # the default job's size, at batch 16
    grouped = padding_fraction(shard(loader_for(tokenizer, lengths), 1, 0))
    shuffled = padding_fraction(shard(loader_for(tokenizer, lengths, "random"), 1, 0))
    assert shuffled > 0.3, "the fixture must pad a lot in random order"
    assert grouped < 0.05, grouped


def test_evaluation_goes_longest_first(tiny_model_dir, review_files):
    run = build_training(tiny_model_dir, review_files, per_device_eval_batch_size=8)
    run.close()
    lengths = [len(batch["input_ids"][0]) for batch in run.eval_loader]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]


def test_sorted_evaluation_gives_the_metrics_of_unsorted_evaluation(tiny_model_dir, review_files):
    run = build_training(tiny_model_dir, review_files, per_device_eval_batch_size=8)
    run.close()
    validation = run.inputs.tokenized["validation"]
    collate = DataCollatorWithPadding(run.inputs.tokenizer)
    unsorted = run.accelerator.prepare(DataLoader(validation, batch_size=8, collate_fn=collate))
    task = run.inputs.task
    sorted_metrics = task.evaluate(run.accelerator, run.policy, run.model, run.eval_loader)
    unsorted_metrics = task.evaluate(run.accelerator, run.policy, run.model, unsorted)
    for name in ("eval/accuracy", "eval/f1"):
        assert sorted_metrics[name] == unsorted_metrics[name], name
    # Padding changes the shapes of the matmuls and so their rounding, never the masked-out values: fp32 eps scale.
    assert sorted_metrics["eval/loss"] == pytest.approx(unsorted_metrics["eval/loss"], rel=1e-5)

    # Per example: the logits of each review, put back into data order, agree to rounding.
    def logits(loader) -> torch.Tensor:
        run.model.eval()
        with torch.no_grad():
            return torch.cat([run.model(**{k: v for k, v in b.items() if k != "labels"}).logits for b in loader])

    in_data_order = torch.empty_like(logits(unsorted))
    in_data_order[torch.tensor(length_order(token_counts(validation)))] = logits(run.eval_loader)
    torch.testing.assert_close(in_data_order, logits(unsorted), rtol=1e-5, atol=1e-5)
    assert torch.equal(in_data_order.argmax(-1), logits(unsorted).argmax(-1))


def saved_after_two_steps(tokenizer, lengths: list[int], strategy: str):
    """A one-process run's loader, and the state and record of its checkpoint after two steps of epoch 0."""
    saving = loader_for(tokenizer, lengths, strategy)
    saved = DataPosition(saving, BATCH, 1, accumulation=1)
    state = TrainState(epoch=0, batches_in_epoch=2)
    state.samples_in_epoch = saved.samples(state)
    return saving, state, CheckpointRecord("r", "no", 1, state, data=saved.record())


@pytest.mark.parametrize("strategy", ["group_by_length", "random"])
def test_a_resume_with_another_seed_keeps_the_runs_order_and_says_so(tokenizer, strategy):
    # The order is drawn from the seed; a resume whose --seed differs would train some examples twice and skip others.
    lengths = mixed_lengths(16 * 6)
    saving, state, record = saved_after_two_steps(tokenizer, lengths, strategy)

    resuming = loader_for(tokenizer, lengths, strategy)
    get_sampler(resuming).seed = SEED + 2  # as --seed 7 would
    notes = DataPosition(resuming, BATCH, 1, accumulation=1).resume(replace(state), record)
    assert notes == [
        f"note: the examples come in the order of the run's seed ({SEED}), so that it continues exactly; "
        f"--seed {SEED + 2} applies to new runs"
    ]
    assert get_sampler(resuming).order(0).tolist() == get_sampler(saving).order(0).tolist()

    fewer = loader_for(tokenizer, lengths[:-16], strategy)  # another training file
    notes = DataPosition(fewer, BATCH, 1, accumulation=1).resume(replace(state), record)
    assert notes == [
        f"note: the training data has {len(lengths) - 16} examples, the checkpoint's run had {len(lengths)}: the rest "
        "of the epoch is not the examples the run would have seen"
    ]


@pytest.mark.parametrize("strategy", ["group_by_length", "random"])
def test_a_resume_on_other_token_counts_says_so_where_the_order_sorts_by_them(tokenizer, strategy):
    # Another --max_length, tokenizer or training file of as many rows sorts the same indices into another grouped
    # order: the rest of the epoch would train some examples twice and others never.
    lengths = mixed_lengths(16 * 6)
    saving, state, record = saved_after_two_steps(tokenizer, lengths, strategy)

    truncated = loader_for(tokenizer, [min(n, 32) for n in lengths], strategy)  # as a lower --max_length
    notes = DataPosition(truncated, BATCH, 1, accumulation=1).resume(replace(state), record)
    if strategy == "random":  # the same order whatever the lengths: the run's examples follow
        assert notes == []
        return
    assert get_sampler(truncated).order(0).tolist() != get_sampler(saving).order(0).tolist()
    assert notes == [
        "note: the training examples have other token counts than the checkpoint's run had (another --max_length, "
        "tokenizer or training data), which the length-grouped order sorts by: the rest of the epoch is not the "
        "examples the run would have seen"
    ]
    # A checkpoint written before the digest was recorded has nothing to compare: no note, as before.
    older = replace(record, data={**record.data, "order": {**record.data["order"]}})
    del older.data["order"]["lengths"]
    assert DataPosition(truncated, BATCH, 1, accumulation=1).resume(replace(state), older) == []


def test_a_resume_keeps_the_runs_seed_from_its_training_args_where_the_checkpoint_has_none():
    # Checkpoints written before they recorded the seed: --seed drew other held-out rows and another order silently.
    from app.config import TrainConfig
    from app.inputs.sampling import keep_the_runs_seed

    older = CheckpointRecord("r", "no", 1, TrainState(), data=None)
    cfg, notes = keep_the_runs_seed(TrainConfig(seed=7), older, {"seed": 42})
    assert cfg.seed == 42 and notes and notes[0].startswith("note: a resume keeps its run's seed (42)")
    # --seed left at its default on a run started with another: the run's, without a note (not asked for)
    cfg, notes = keep_the_runs_seed(TrainConfig(), older, {"seed": 7})
    assert (cfg.seed, notes) == (7, [])
