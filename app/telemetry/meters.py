"""The meters the loop feeds: cheap device-side adds every micro-step, one host read per log step (tags: tags.py).

Values accumulate on the device between log steps and are read to the host only in `Telemetry.log` (why: the loop's
docstring). With several processes, throughput (samples, tokens, MFU) is summed over the ranks, memory and the fp16
activations of amp/headroom_bits are the maximum over the ranks, and the loss is the mean over the ranks. The scaler's
tags are written only while loss scaling is on. At start, the run's custom-scalars layout (layout.py) names the charts
of exactly the tags this run writes.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable

import psutil
import torch
from tqdm.auto import tqdm

from app.amp.headroom import HeadroomProbe
from app.amp.policy import PrecisionPolicy
from app.telemetry.flops import head_positions, peak_flops, training_flops
from app.telemetry.layout import run_layout
from app.telemetry.tags import (
    AMP_APPLIED_UPDATES,
    AMP_CONSECUTIVE_SKIPS,
    AMP_HEADROOM_BITS,
    AMP_HEADROOM_MODULE,
    AMP_LOSS_SCALE,
    AMP_SKIP_RATE,
    AMP_SKIPPED_STEPS,
    HPARAM_METRICS,
    MEMORY_ALLOC_RETRIES,
    MEMORY_ALLOCATED_GIB,
    MEMORY_OOMS,
    MEMORY_PEAK_ALLOCATED_GIB,
    MEMORY_PEAK_ALLOCATED_PCT,
    MEMORY_PEAK_RESERVED_PCT,
    MEMORY_RESERVED_GIB,
    MEMORY_RSS_GIB,
    PERF_MFU_PCT,
    PERF_PADDING_FRACTION,
    PERF_SAMPLES_PER_SEC,
    PERF_STEP_TIME_MS,
    PERF_TOKENS_PER_SEC,
    PERF_TOKENS_PER_SEC_PER_DEVICE,
    RUN_SAMPLES_PER_SEC,
    TRAIN_EPOCH,
    TRAIN_GRAD_NORM,
    TRAIN_LOSS,
    TRAIN_LR,
)

GIB = 2**30


def peak_memory_tag(device: torch.device) -> tuple[str, str]:
    """The memory tag that holds the peak on this device, and what it measures in words."""
    if device.type == "cuda":
        return MEMORY_PEAK_ALLOCATED_GIB, "GPU peak allocated"
    return MEMORY_RSS_GIB, "CPU RSS"


def high_water_mark_gib() -> float | None:
    """The most memory this process has held resident since it started: loading and the evaluations included, which
    the RSS read at log steps misses. None where the OS does not say (Windows). A process started by fork (a forked
    rank, a run inside the caller's process) counts what its parent held before."""
    try:
        import resource
    except ImportError:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / GIB if sys.platform == "darwin" else peak * 1024 / GIB  # bytes on macOS, KiB on Linux


def gpu_memory_tags(stats: dict[str, int], device_bytes: int) -> dict[str, float]:
    """The memory tags from `torch.cuda.memory_stats(device)`: GiB, the peaks as a share of the device's
    `device_bytes`, and the allocator's cumulative retries (a full cache flush each) and out-of-memory errors."""
    return {
        MEMORY_ALLOCATED_GIB: stats["allocated_bytes.all.current"] / GIB,
        MEMORY_RESERVED_GIB: stats["reserved_bytes.all.current"] / GIB,
        MEMORY_PEAK_ALLOCATED_GIB: stats["allocated_bytes.all.peak"] / GIB,
        MEMORY_PEAK_ALLOCATED_PCT: 100 * stats["allocated_bytes.all.peak"] / device_bytes,
        MEMORY_PEAK_RESERVED_PCT: 100 * stats["reserved_bytes.all.peak"] / device_bytes,
        MEMORY_ALLOC_RETRIES: stats["num_alloc_retries"],
        MEMORY_OOMS: stats["num_ooms"],
    }


def memory_probe(device: torch.device) -> Callable[[], dict[str, float]]:
    """Picked once, so the loop has no device `if`. Host-side queries: no device sync."""
    if device.type == "cuda":
        device_bytes = torch.cuda.get_device_properties(device).total_memory

        def gpu_memory() -> dict[str, float]:
            values = gpu_memory_tags(torch.cuda.memory_stats(device), device_bytes)
            torch.cuda.reset_peak_memory_stats(device)  # peaks since the previous log
            return values

        return gpu_memory
    process = psutil.Process()
    return lambda: {MEMORY_RSS_GIB: process.memory_info().rss / GIB}


class Telemetry:
    """Meters for the loop: cheap device-side adds every micro-step, one host read per log step.

    `start` is the TrainState the run begins from (a fresh one, or a resumed one). `probe_headroom=False` leaves
    amp/headroom_bits out (under --torch_compile, where the probe's hooks would recompile the model).
    """

    def __init__(
        self,
        accelerator,
        writer,
        model: torch.nn.Module,
        policy: PrecisionPolicy,
        total_steps: int,
        start,
        disable_progress: bool,
        probe_headroom: bool,
        eval_metrics: tuple[str, ...],
    ):
        self.accelerator, self.writer = accelerator, writer
        device = accelerator.device
        self._memory = memory_probe(device)
        self._synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self._flops = training_flops(model)
        peak = peak_flops(device, policy.mode)
        self._peak_flops = peak * accelerator.num_processes if peak else None
        self.headroom = HeadroomProbe(enabled=probe_headroom)  # the loop arms it; log() reads it
        self._headroom_module: str | None = None  # the module named in the last amp/headroom_module text
        fp16 = policy.mode == "fp16"
        if fp16 and not probe_headroom:
            accelerator.print("note: amp/headroom_bits is not measured under --torch_compile (hooks would recompile)")
        scaler, mfu = policy.scaler_enabled, bool(self._flops and self._peak_flops)
        writer.layout(run_layout(scaler, fp16 and probe_headroom, device.type, mfu, eval_metrics))
        # Losses are summed weighted by their items (examples, label tokens): train/loss is the mean over all items.
        self._loss_sum = torch.zeros((), device=device)  # over the log interval
        self.step_loss = torch.zeros((), device=device)  # over the current optimizer step's micro-batches
        self._real_tokens = torch.zeros((), device=device, dtype=torch.int64)
        self._grad_norm = torch.zeros((), device=device)
        self._items = self._samples = self._padded_tokens = self._head_positions = self._timed_steps = 0
        self._last_log = (start.opt_step, start.skipped_steps)  # where the current interval began
        self._continue_interval(start)
        self._timed_seconds = 0.0  # of the current interval, pauses excluded
        self._clock = time.perf_counter()
        self.run_samples, self.run_seconds, self.peak_memory_gib = 0, 0.0, 0.0
        self.run_steps = 0  # optimizer steps this process took (a resume with nothing left to train takes none)
        self._peak_tag, self.peak_memory_kind = peak_memory_tag(device)
        self._bar = tqdm(
            total=total_steps,
            initial=start.opt_step,
            unit="step",
            dynamic_ncols=True,
            disable=disable_progress or not accelerator.is_main_process,
        )

    # ---- called from the loop: no host syncs ---------------------------------------------------------------------
    def add_micro_batch(self, loss: torch.Tensor, items: int, batch: dict) -> None:
        """`loss`: the micro-batch's mean over its `items` (a host count)."""
        self.step_loss += loss.detach().float() * items
        self._real_tokens += batch["attention_mask"].sum()
        self._items += items
        self._samples += batch["input_ids"].shape[0]
        self._padded_tokens += batch["input_ids"].numel()
        self._head_positions += head_positions(batch)

    def add_optimizer_step(self, grad_norm: torch.Tensor) -> None:
        """Close the step: its summed micro-batch loss joins the interval's. Read `step_loss` before this."""
        self._loss_sum += self.step_loss
        self.step_loss.zero_()
        self._grad_norm = grad_norm.detach()
        self._timed_steps += 1
        self.run_steps += 1
        self._bar.update(1)

    def restart_clock(self) -> None:
        """Start timing afresh: after the warm-up step (which may include compilation), throughput excludes it."""
        self._synchronize()  # the warm-up step's kernels finish before the clock starts
        self._zero_timing()

    def _zero_timing(self, since: float | None = None) -> None:
        self._samples = self._padded_tokens = self._head_positions = self._timed_steps = 0
        self._real_tokens.zero_()
        self._timed_seconds = 0.0
        self._clock = time.perf_counter() if since is None else since

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside (evaluation, checkpoints) is left out of throughput."""
        self._synchronize()
        self._timed_seconds += time.perf_counter() - self._clock
        try:
            yield
        finally:
            self._clock = time.perf_counter()

    # ---- log steps: the one host read of the interval ------------------------------------------------------------
    def log(self, step: int, state, lr: float, loss_scale: float | None, epoch: float) -> None:
        """Reduce over ranks, read to the host and write. Every rank must call it at the same steps.

        `loss_scale` is None without loss scaling: then the scaler's tags are left out.
        """
        device = self._loss_sum.device
        host_counts = torch.tensor(
            [self._items, self._samples, self._padded_tokens, self._head_positions], dtype=torch.float64, device=device
        )
        counts = torch.cat([self._loss_sum.double().view(1), self._real_tokens.double().view(1), host_counts])
        summed = self.accelerator.reduce(counts, "sum").tolist()  # host sync: the one read of this interval
        now = time.perf_counter()
        seconds = self._timed_seconds + now - self._clock
        loss_sum, real_tokens, items, samples, padded_tokens, heads = summed
        memory = self._memory()
        memory = dict(
            zip(memory, self.accelerator.reduce(torch.tensor(list(memory.values()), device=device), "max").tolist())
        )
        grad_norm = self._grad_norm.item()  # the device is idle after the read above; identical on every rank
        headroom = self.headroom.take(lambda maxima: self.accelerator.reduce(maxima, "max"))

        scalars = {
            TRAIN_LOSS: loss_sum / max(items, 1),
            TRAIN_LR: lr,
            TRAIN_GRAD_NORM: grad_norm,  # inf/NaN on overflow steps, shown as they are
            TRAIN_EPOCH: epoch,
            **memory,
        }
        if loss_scale is not None:
            scalars |= {
                AMP_LOSS_SCALE: loss_scale,
                AMP_SKIPPED_STEPS: state.skipped_steps,
                AMP_SKIP_RATE: (state.skipped_steps - self._last_log[1]) / max(step - self._last_log[0], 1),
                AMP_CONSECUTIVE_SKIPS: state.consecutive_skips,
                AMP_APPLIED_UPDATES: state.applied_updates,
            }
        if headroom is not None:
            scalars[AMP_HEADROOM_BITS] = headroom.bits
            if headroom.module != self._headroom_module:
                self._headroom_module = headroom.module
                self.writer.text(AMP_HEADROOM_MODULE, headroom.said(), step)
        if self._timed_steps and seconds > 0:
            scalars |= {
                PERF_SAMPLES_PER_SEC: samples / seconds,
                PERF_TOKENS_PER_SEC: real_tokens / seconds,
                PERF_TOKENS_PER_SEC_PER_DEVICE: real_tokens / seconds / self.accelerator.num_processes,
                PERF_PADDING_FRACTION: 1 - real_tokens / max(padded_tokens, 1),
                PERF_STEP_TIME_MS: 1000 * seconds / self._timed_steps,
            }
            if self._flops and self._peak_flops:
                achieved = self._flops.of(padded_tokens, samples, heads) / seconds
                scalars[PERF_MFU_PCT] = 100 * achieved / self._peak_flops
            self.run_samples += samples
            self.run_seconds += seconds
        self.writer.log(scalars, step)
        self.peak_memory_gib = max(self.peak_memory_gib, memory[self._peak_tag])
        scale = {} if loss_scale is None else {"scale": f"{loss_scale:g}"}
        self._bar.set_postfix(
            loss=f"{scalars[TRAIN_LOSS]:.4f}",
            **scale,
            samples_per_s=f"{scalars.get(PERF_SAMPLES_PER_SEC, 0):.1f}",
            refresh=False,
        )
        # The next interval is timed from this read on: the logging above is part of a logged step's cost, and timed
        # from the end of it, --logging_steps 1 reported a throughput 12% above the wall clock's on a tiny model.
        self._reset_interval(state, since=now)

    def _reset_interval(self, state, since: float | None = None) -> None:
        self._loss_sum.zero_()
        self._items = 0
        self._last_log = (state.opt_step, state.skipped_steps)
        self._zero_timing(since)  # no synchronize: the read in log() already waited for the device

    def rewind(self, state) -> None:
        """Continue from an earlier `state` (a fallback to a checkpoint): its interval, the bar moved back."""
        self.step_loss.zero_()
        self._reset_interval(state)
        self._continue_interval(state)
        self._bar.n = state.opt_step

    # ---- checkpoints: the logging interval they cut ---------------------------------------------------------------
    def record_interval(self, state) -> None:
        """Record the current logging interval in `state`, which a checkpoint is about to save. Collective."""
        # One gather of [loss sum, items] per rank: float64 holds the float32 sum and the count exactly.
        mine = torch.stack([self._loss_sum.double(), torch.tensor(float(self._items), device=self._loss_sum.device)])
        gathered = self.accelerator.gather(mine.view(1, 2)).tolist()
        state.interval_losses = [loss for loss, _ in gathered]
        state.interval_items = [int(items) for _, items in gathered]
        state.interval_start = list(self._last_log)

    def _continue_interval(self, start) -> None:
        """Go on with the interval a resumed checkpoint recorded: each rank its own part (float32 sums, as they were);
        with another process count, the main process holds the whole of it."""
        if start.interval_losses is None:
            return
        ranks, rank = self.accelerator.num_processes, self.accelerator.process_index
        if len(start.interval_losses) == ranks:
            loss, items = start.interval_losses[rank], start.interval_items[rank]
        else:
            main = rank == 0
            loss, items = sum(start.interval_losses) * main, sum(start.interval_items) * main
        self._loss_sum.fill_(loss)
        self._items = int(items)
        self._last_log = tuple(start.interval_start)

    @property
    def samples_per_sec(self) -> float | None:
        """The run's throughput over all its timed intervals; None before two steps (the first is warm-up)."""
        return self.run_samples / self.run_seconds if self.run_samples and self.run_seconds > 0 else None

    def write_hparams_row(self, step: int, hparams: dict) -> None:
        """The run's row in HPARAMS: its settings, and its last points of HPARAM_METRICS, the run's throughput
        logged for it here."""
        if self.samples_per_sec is not None:
            self.writer.log({RUN_SAMPLES_PER_SEC: self.samples_per_sec}, step)
        self.writer.hparams(hparams, HPARAM_METRICS)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.writer.log(metrics, step)
        if self.accelerator.is_main_process:  # tqdm.write prints even where this rank's bar is disabled
            self._bar.write(f"step {step}: " + ", ".join(f"{tag} {value:.4f}" for tag, value in metrics.items()))

    def close(self) -> None:
        self._bar.close()
        self.writer.close()
