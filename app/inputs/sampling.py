"""Batch orders: the training order of each epoch, where training stands in it, and evaluation in length order.

The training order is a pure function of the seed and the epoch (and, length-grouped, of the step size the run
started with, which stays with the run): no global RNG is drawn, and a resume's process count plays no part.
Accelerate only cuts the order into batches: with N processes, batch i goes to rank i % N (BatchSamplerShard), and
`set_epoch` reaches the sampler through `batch_sampler.sampler`. So a position in the order, counted in examples,
means the same under any process count, and a resume continues from it exactly: nothing trained twice, nothing
skipped (DataPosition).

Dynamic padding pads a batch to its longest example, so a batch of mixed lengths computes much padding (see
docs/benchmarks.md for the default job's share). Grouping examples of similar length into batches removes most of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import cached_property

import torch
from torch.utils.data import Sampler

from app.config import TrainConfig, recorded_value
from app.errors import counted

# As HF Trainer's LengthGroupedSampler: sort within ~50 steps, enough to pad little, few enough to stay shuffled.
MEGA_BATCH_BATCHES = 50


class EpochOrder(Sampler[int]):
    """Example indices in an order fixed by (seed, epoch); a resume may start one epoch at any example."""

    def __init__(self, num_examples: int, seed: int):
        self.num_examples, self.seed, self.epoch = num_examples, seed, 0
        self.resumed_at: tuple[int, int] | None = None  # (epoch, examples of it to leave out), set by a resume

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_examples

    def __iter__(self) -> Iterator[int]:
        yield from self.order(self.epoch)[self.skipped(self.epoch) :].tolist()

    def skipped(self, epoch: int) -> int:
        """Examples that this sampler leaves out at the start of `epoch`: a resume's part of a batch, else 0."""
        return self.resumed_at[1] if self.resumed_at and self.resumed_at[0] == epoch else 0

    def order(self, epoch: int) -> torch.Tensor:
        raise NotImplementedError

    def spec(self) -> dict:
        """What, besides seed and epoch, the order depends on: recorded in checkpoints, followed on resume."""
        raise NotImplementedError

    def follow(self, spec: dict) -> bool:
        """Take the order of the run that wrote `spec`. Returns False if this sampler cannot produce it."""
        raise NotImplementedError


class ShuffledSampler(EpochOrder):
    """Plain shuffled examples: the order Accelerate's seedable sampler gives (a randperm seeded by seed + epoch)."""

    def order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.num_examples, generator=torch.Generator().manual_seed(self.seed + epoch))

    def spec(self) -> dict:
        return {"strategy": "random"}

    def follow(self, spec: dict) -> bool:
        return spec.get("strategy") == "random"


class LengthGroupedSampler(EpochOrder):
    """Example indices in length-grouped order, for optimizer steps of `step_size` examples (a batch on each process,
    times the accumulation).

    One epoch: shuffle every index with a generator seeded by (seed + epoch); cut that order into mega-batches of
    about 50 steps; sort each by length, longest first; cut it into steps (their micro-batches, one batch per rank
    each, neighbours in length order, so no rank waits on another's long batch); shuffle the order of the steps. An
    optimizer step trains on the same examples however it is cut into micro-batches and ranks, as with HF Trainer,
    which groups by batch x accumulation. An incomplete last step stays last: Accelerate pads it out (even_batches)
    only there.

    The step size is the one the run started with, and stays with the run: checkpoints record it (spec()), and a
    resume with another process count follows it (follow()), only cutting the same order into other batches. They
    record a digest of the lengths too: other token counts (another --max_length, tokenizer or training file of as
    many rows) sort the same indices into another order, which a resume cannot follow (DataPosition.resume says so).
    """

    def __init__(self, lengths: Sequence[int], step_size: int, seed: int):
        super().__init__(len(lengths), seed)
        self.lengths = torch.as_tensor(lengths, dtype=torch.int64)
        self.group_size = step_size  # examples sorted into one step
        self.mega_batch_size = step_size * MEGA_BATCH_BATCHES

    def spec(self) -> dict:
        return {
            "strategy": "group_by_length",
            "group_size": self.group_size,
            "mega_batch_size": self.mega_batch_size,
            "lengths": self.lengths_digest,
        }

    @cached_property
    def lengths_digest(self) -> str:
        """The token counts the order sorts by, hashed: computed once, recorded at every checkpoint."""
        return hashlib.sha256(self.lengths.numpy().tobytes()).hexdigest()

    def follow(self, spec: dict) -> bool:
        if spec.get("strategy") != "group_by_length":
            return False
        self.group_size, self.mega_batch_size = spec["group_size"], spec["mega_batch_size"]
        return True

    def order(self, epoch: int) -> torch.Tensor:
        """The indices of an epoch, in the order the batches are cut from."""
        generator = torch.Generator().manual_seed(self.seed + epoch)
        shuffled = torch.randperm(len(self.lengths), generator=generator)
        grouped = torch.cat(
            [
                mega[torch.sort(self.lengths[mega], descending=True, stable=True).indices]
                for mega in shuffled.split(self.mega_batch_size)
            ]
        )
        groups = list(grouped.split(self.group_size))
        last = [groups.pop()] if len(groups[-1]) < self.group_size else []
        group_order = torch.randperm(len(groups), generator=generator).tolist()
        return torch.cat([groups[i] for i in group_order] + last)


def train_sampler(cfg, lengths: Sequence[int], num_processes: int) -> EpochOrder:
    """The training order that --train_sampling_strategy asks for, over examples of these token counts, for a run
    that starts with `num_processes` (a resumed run then follows the order its checkpoint records)."""
    if cfg.train_sampling_strategy == "group_by_length":
        step_size = cfg.per_device_train_batch_size * num_processes * cfg.gradient_accumulation_steps
        return LengthGroupedSampler(lengths, step_size, cfg.seed)
    return ShuffledSampler(len(lengths), cfg.seed)


class DataPosition:
    """Where training stands in the epoch's order, in examples over all ranks: what each checkpoint records, and
    where a resume continues, whatever its process count or batch size.

    A resume that cuts the order into batches of another size starts its first epoch in two parts: whole batches
    skipped by the loop (state.batches_in_epoch, through skip_first_batches), and the rest of a batch left out by
    the sampler (EpochOrder.resumed_at). With the same process count and batch size the second part is 0, and the
    resume replays exactly the batches of the run that saved the checkpoint.
    """

    def __init__(self, train_loader, batch_size: int, num_processes: int, accumulation: int):
        self.sampler = _find_order(train_loader)
        self.batch_size, self.num_processes, self.accumulation = batch_size, num_processes, accumulation
        self.examples_per_micro_step = batch_size * num_processes
        self.global_batch_size = self.examples_per_micro_step * accumulation

    def samples(self, state) -> int:
        """Examples of this epoch already trained on, over all ranks."""
        consumed = self.sampler.skipped(state.epoch) + state.batches_in_epoch * self.examples_per_micro_step
        return min(consumed, self.sampler.num_examples)  # Accelerate pads an epoch's last step out: not examples

    def epoch(self, state) -> float:
        """The fractional epoch, by examples: the same at each step whatever the process count (a resume on another
        cuts the epoch into other batches, whose count rounds otherwise)."""
        return state.epoch + self.samples(state) / self.sampler.num_examples

    def record(self) -> dict:
        """The order's spec, the global batch, and what the order is drawn from: the seed and the examples' count."""
        return {
            "order": self.sampler.spec(),
            "global_batch_size": self.global_batch_size,
            "seed": self.sampler.seed,
            "examples": self.sampler.num_examples,
        }

    def resume(self, state, record) -> list[str]:
        """Continue at the checkpoint's example: set `state.batches_in_epoch` and the sampler. Returns notes.

        `record` (storage/checkpoints.CheckpointRecord, through recorded_in_examples) has the order the run followed
        and its position in examples; how the run's steps stay the same size: batch_shape.py.
        """
        state.batches_in_epoch, rest = divmod(state.samples_in_epoch, self.examples_per_micro_step)
        self.sampler.resumed_at = (state.epoch, rest)
        notes = []
        seed, examples = record.data.get("seed"), record.data.get("examples")  # absent in older checkpoints
        if seed is not None and seed != self.sampler.seed:  # train.py keeps the run's seed; a sampler built otherwise
            notes.append(
                f"note: the examples come in the order of the run's seed ({seed}), so that it continues exactly; "
                f"--seed {self.sampler.seed} applies to new runs"
            )
            self.sampler.seed = seed
        if examples is not None and examples != self.sampler.num_examples:
            notes.append(
                f"note: the training data has {counted(self.sampler.num_examples, 'example')}, the checkpoint's run "
                f"had {examples}: the rest of the epoch is not the examples the run would have seen"
            )
        order = record.data["order"]
        if not self.sampler.follow(order):
            notes.append(
                "note: --train_sampling_strategy changed since the checkpoint, so the rest of the epoch is not the "
                "examples the run would have seen"
            )
        elif examples in (None, self.sampler.num_examples) and _sorted_by_other_lengths(order, self.sampler):
            notes.append(
                "note: the training examples have other token counts than the checkpoint's run had (another "
                "--max_length, tokenizer or training data), which the length-grouped order sorts by: the rest of the "
                "epoch is not the examples the run would have seen"
            )
        return notes


def _sorted_by_other_lengths(recorded: dict, sampler: EpochOrder) -> bool:
    """Whether the run's order (`recorded`, its spec) sorted other token counts than `sampler` has. Checkpoints
    written before the digest was recorded, and orders that do not sort by length, give no answer: False."""
    digest = recorded.get("lengths")
    return digest is not None and digest != sampler.spec().get("lengths")


def keep_the_runs_seed(cfg, record, recorded: dict):
    """A resume's config with the seed its run recorded (its checkpoint, else its training_args.yaml: `recorded`),
    and a note if --seed asked for another: the seed draws the held-out validation rows and the examples' order, so
    another one would train some examples twice, skip others, and evaluate on training rows. (The weights, the
    dropout's and the adapters' draws come from the checkpoint.)"""
    seed = (record.data or {}).get("seed", recorded.get("seed"))  # the checkpoint's is absent in older ones
    if not isinstance(seed, int) or isinstance(seed, bool) or seed == cfg.seed:
        return cfg, []
    if cfg.seed == TrainConfig.defaults()["seed"]:  # most likely not asked for (the run's command without the flag)
        return replace(cfg, seed=seed), []
    note = (
        f"note: a resume keeps its run's seed ({seed}): the same held-out validation rows and order of the examples, "
        f"so that it continues exactly; --seed {cfg.seed} applies to new runs"
    )
    return replace(cfg, seed=seed), [note]


def recorded_in_examples(record, cfg, recorded: dict):
    """`record` (storage/checkpoints.CheckpointRecord) with its order, global batch and position in examples.

    Checkpoints written before these were recorded grouped their order by batch size x processes and counted their
    position in batches: of the batch size, accumulation and strategy in the run's training_args.yaml (`recorded`),
    and of the flags only where it has none, so that a resume with other flags keeps the run's batches and says so.
    """
    if record.data is not None and record.state.samples_in_epoch is not None:
        return record
    per_device = _recorded_count(recorded, "per_device_train_batch_size", cfg.per_device_train_batch_size)
    accumulation = _recorded_count(recorded, "gradient_accumulation_steps", cfg.gradient_accumulation_steps)
    strategy = recorded_value(recorded, "train_sampling_strategy") or cfg.train_sampling_strategy
    group = per_device * record.num_processes
    order = {"strategy": strategy, "group_size": group, "mega_batch_size": group * MEGA_BATCH_BATCHES}
    state = replace(record.state, samples_in_epoch=record.state.batches_in_epoch * group)
    data = {"order": order, "global_batch_size": group * accumulation}
    return replace(record, state=state, data=data)


def _recorded_count(recorded: dict, name: str, flag: int) -> int:
    """A positive count that training_args.yaml records under `name`; the flag's value where it records none."""
    value = recorded_value(recorded, name)
    return value if value is not None and value > 0 else flag


def _find_order(loader) -> EpochOrder:
    """The app's sampler under Accelerate's wrappers (BatchSampler, and BatchSamplerShard with several processes)."""
    found = loader.batch_sampler
    while not isinstance(found, EpochOrder):
        found = getattr(found, "batch_sampler", None) or found.sampler
    return found


def length_order(lengths: Sequence[int]) -> list[int]:
    """Indices longest first: evaluation batches pad least, and a batch too large for memory fails at once."""
    return torch.sort(torch.as_tensor(lengths, dtype=torch.int64), descending=True, stable=True).indices.tolist()


def token_counts(dataset) -> list[int]:
    """Tokens per example: the length that padding goes by."""
    return [len(ids) for ids in dataset["input_ids"]]
