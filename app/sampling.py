"""Batch orders: length-grouped training batches, and evaluation in length order.

Dynamic padding pads a batch to its longest example, so a batch of mixed lengths computes much padding (see
docs/benchmarks.md for the default job's share). Grouping examples of similar length into batches removes most of it.

The training order is a pure function of (seed, epoch, number of processes): no global RNG is drawn, so an exact
resume (set_epoch, then skip the batches already consumed) replays the same batches. Accelerate cuts this index order
into batches with a plain BatchSampler, and under several processes gives batch i to rank i % num_processes
(BatchSamplerShard), which reaches `set_epoch` here through `batch_sampler.sampler`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

# As HF Trainer's LengthGroupedSampler: sort within ~50 batches, enough to pad little, few enough to stay shuffled.
MEGA_BATCH_BATCHES = 50


class LengthGroupedSampler(Sampler[int]):
    """Example indices in length-grouped order, for batches of `batch_size` on each of `num_processes` ranks.

    One epoch: shuffle every index with a generator seeded by (seed + epoch); cut that order into mega-batches of
    about 50 steps; sort each mega-batch by length, longest first; cut it into steps (one batch per rank, neighbours
    in length order, so no rank waits on another's long batch); shuffle the order of the steps. An incomplete last
    step stays last: Accelerate pads it out (even_batches) only there.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, num_processes: int, seed: int):
        self.lengths = torch.as_tensor(lengths, dtype=torch.int64)
        self.step_size = batch_size * num_processes  # examples per optimizer micro-step, over all ranks
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        yield from self.order(self.epoch).tolist()

    def order(self, epoch: int) -> torch.Tensor:
        """The indices of an epoch, in the order the batches are cut from."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        shuffled = torch.randperm(len(self.lengths), generator=generator)
        grouped = torch.cat(
            [
                mega[torch.sort(self.lengths[mega], descending=True, stable=True).indices]
                for mega in shuffled.split(self.step_size * MEGA_BATCH_BATCHES)
            ]
        )
        steps = list(grouped.split(self.step_size))
        last = [steps.pop()] if len(steps[-1]) < self.step_size else []
        step_order = torch.randperm(len(steps), generator=generator).tolist()
        return torch.cat([steps[i] for i in step_order] + last)


def length_order(lengths: Sequence[int]) -> list[int]:
    """Indices longest first: evaluation batches pad least, and a batch too large for memory fails at once."""
    return torch.sort(torch.as_tensor(lengths, dtype=torch.int64), descending=True, stable=True).indices.tolist()


def token_counts(dataset) -> list[int]:
    """Tokens per example: the length that padding goes by."""
    return [len(ids) for ids in dataset["input_ids"]]
