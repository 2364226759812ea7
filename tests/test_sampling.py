"""Batch orders: length-grouped training batches through Accelerate's real wrappers, and evaluation in length order."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from accelerate import skip_first_batches
from accelerate.data_loader import prepare_data_loader
from datasets import Dataset, DatasetDict
from torch.utils.data import DataLoader
from transformers import AutoTokenizer, DataCollatorWithPadding

from app.config import TrainConfig
from app.data import make_loaders
from app.sampling import LengthGroupedSampler, length_order, token_counts
from tests.harness import build_run

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
    sampler = LengthGroupedSampler(lengths, BATCH, 1, SEED)
    first, again = sampler.order(0), LengthGroupedSampler(lengths, BATCH, 1, SEED).order(0)
    assert torch.equal(first, again)
    assert sorted(first.tolist()) == list(range(1000))
    assert not torch.equal(first, sampler.order(1)), "each epoch is shuffled anew"
    assert not torch.equal(first, LengthGroupedSampler(lengths, BATCH, 1, SEED + 1).order(0))
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
    run = build_run(tiny_model_dir, review_files, per_device_eval_batch_size=8)
    run.close()
    lengths = [len(batch["input_ids"][0]) for batch in run.eval_loader]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]


def test_sorted_evaluation_gives_the_metrics_of_unsorted_evaluation(tiny_model_dir, review_files):
    run = build_run(tiny_model_dir, review_files, per_device_eval_batch_size=8)
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
