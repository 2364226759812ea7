"""The training loop: one function for fp32, fp16 and bf16, with the optimizer step and the end-of-step decisions.

There is no `if amp:` here. `policy.autocast()` and the scaler are called the same way in every mode; with AMP off
they are exact no-ops. The loop knows nothing of tasks: a batch goes into the model, and the model returns the loss.

One optimizer step, in the order it happens:
1. the micro-batches of the step (`--gradient_accumulation_steps` of them; fewer at the end of an epoch): forward
   under autocast, backward of the scaled loss, each micro-batch's mean loss weighed by its share of the step's items
   (`step_weights`), the meters (telemetry);
2. `optimizer_step`: unscale, clip, settle the previous step (`StepLedger`), send this step's overflow flag to the
   host, step, update the scale;
3. `StepDue`: what this step must do besides the update, decided in one place: log, evaluate, save, stop, last;
4. in this order: settle this step and check for non-finite losses; log; the loss-scale alarm (stop, warn, or fall
   back to a checkpoint and carry on from there); evaluate (best model, early stopping); save; stop on a signal.

Host syncs. This is the one place that says why the loop reads so little from the device. Every read of a device
value (`.item()`, a Python `if` on a tensor, a blocking copy) makes the host wait for the GPU to finish all queued
work, so the next step cannot be queued while this one runs. Between log steps the loop therefore reads nothing:
- with AMP off, nothing at all;
- with fp16 on a fused optimizer (see optim.py), the overflow flag travels to the host without blocking and is read
  one step later (amp.scaler.OverflowFlag, StepLedger below); the loss scale is read on skipped steps only
  (amp.watches.ScaleWatch);
- losses, token counts and gradient norms accumulate on the device (telemetry.meters), non-finite losses are counted
  on the device (amp.watches.LossWatch).
Everything is read at log, checkpoint and stop steps, and at the last step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from accelerate import skip_first_batches

from app.amp import diagnose, fallback
from app.amp.scaler import OverflowFlag, loss_scale
from app.amp.watches import LossWatch, ScaleWatch
from app.best import BestModel
from app.errors import NUMERIC_FAULT_EXIT_CODE, TrainingHalted
from app.evaluation import evaluates_during_training
from app.host.runtime import HostCollective
from app.telemetry.tags import TRAIN_STOPPED_EARLY
from app.wiring import Training


class StepLedger:
    """Settles each optimizer step as applied or skipped once its overflow flag is on the host, and moves the LR on.

    A step is normally settled one step late, when its flag has long landed (see amp.scaler.OverflowFlag), and still
    before the next update, so the LR follows applied updates exactly. At log, checkpoint and stop points the loop
    settles the current step at once: the one host sync of those steps.
    """

    def __init__(self, training: Training):
        self.state, self.schedule, self.scaler = training.state, training.schedule, training.scaler
        cfg = training.cfg
        self.scale_watch = ScaleWatch(
            cfg.min_loss_scale, cfg.max_consecutive_skips, cfg.on_scale_collapse, training.policy.device_type
        )
        self.overflow = OverflowFlag(training.scaler, training.accelerator.device)
        self.alarm: str | None = None  # the loss-scale alarm's diagnostic, once it fires
        self.alarm_step = 0  # the step it fired at: the one settled, which may be the step before the current one
        # The alarm's step's last micro-batch and what it multiplied that batch's loss by, for the overflow report. The
        # step is settled one step late, so the captured step's inputs are kept until then (a reference, no copy).
        self.replay: tuple[dict, float] | None = None
        self._captured: tuple[dict, float] | None = None

    def capture(self, optimizer: torch.optim.Optimizer, inputs: tuple[dict, float]) -> None:
        """Start the current step's flag on its way (OverflowFlag.capture); `inputs`: its last micro-batch and the
        weight of that batch's loss."""
        self.overflow.capture(optimizer)
        self._captured = inputs

    def settle(self) -> None:
        skipped = self.overflow.read()
        if skipped is None:
            return
        self.state.record_outcome(skipped)
        if not skipped:
            self.schedule.step()
        if not self.alarm and (alarm := self.scale_watch.after_step(self.state, skipped, self.scaler)):
            # The settled step's: the next step's capture, which would replace it, comes after its settle.
            self.alarm, self.alarm_step, self.replay = alarm, self.state.opt_step, self.captured()

    def captured(self) -> tuple[dict, float]:
        """The captured step's last micro-batch and what that step multiplied its loss by (its loss scale times the
        batch's weight): what an overflow report replays. Reads the scale to the host."""
        batch, weight = self._captured
        return batch, self.overflow.scale_used() * weight


def by_optimizer_step(batches: Iterable[dict], micro_batches: int) -> Iterator[list[dict]]:
    """The batches in groups of `micro_batches`, one group per optimizer step; an epoch's last group may be shorter."""
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == micro_batches:
            yield group
            group = []
    if group:
        yield group


def optimizer_steps(training: Training) -> Iterator[list[dict]]:
    """The micro-batches of each optimizer step, epoch after epoch, from where `training.state` stands.

    The one place an epoch ends: its counters move on when the next step is asked for. On a resume, what the epoch
    already consumed is skipped: the seedable sampler replays the same order.
    """
    state, loader = training.state, training.train_loader
    while True:
        loader.set_epoch(state.epoch)
        batches = skip_first_batches(loader, state.batches_in_epoch) if state.batches_in_epoch else loader
        yield from by_optimizer_step(batches, training.cfg.gradient_accumulation_steps)
        state.epoch += 1
        state.batches_in_epoch = 0


def step_weights(items: list[int], host: HostCollective, num_processes: int) -> list[float]:
    """What each micro-batch's mean loss is multiplied by, so that the step's gradient is that of the mean over all its
    items (examples, label tokens) on every rank, as HF Trainer weighs them: the same loss whatever the accumulation
    and the process count. DDP averages gradients over the ranks, hence the factor `num_processes`.
    One process, one micro-batch: exactly 1.0, so the loss reaches backward unchanged."""
    total = host.sum(sum(items))  # collective on a CPU group, once per optimizer step, when there are several ranks
    return [count * num_processes / max(total, 1) for count in items]


def optimizer_step(training: Training, ledger: StepLedger, inputs: tuple[dict, float]) -> tuple[torch.Tensor, float]:
    """Unscale, clip, step, update, zero the gradients. Returns the unscaled gradient norm (inf/NaN on overflow) and
    the learning rate of the update (logged as HF does, not the next step's). `inputs`: the step's last micro-batch
    and its loss weight, kept for an overflow report until the step is settled."""
    # The raw optimizer: the scaler hands a fused one the overflow flag, which Accelerate's wrapper would not pass on.
    optimizer = training.optimizer.optimizer
    training.scaler.unscale_(optimizer)
    # With clipping off, the norm is still computed (for telemetry); an infinite bound leaves the gradients as they are.
    grad_norm = training.accelerator.clip_grad_norm_(
        training.model.parameters(), training.cfg.max_grad_norm or float("inf")
    )
    ledger.settle()  # the previous step, whose flag landed long ago: sets the LR this update uses
    lr = training.schedule.get_last_lr()[0]
    ledger.capture(optimizer, inputs)
    training.scaler.step(optimizer)
    training.scaler.update()
    training.optimizer.zero_grad(set_to_none=True)
    return grad_norm, lr


def log_step(training: Training, step: int, lr: float) -> None:
    """The step's curves (train/*, amp/*, perf/*, memory/*): what the telemetry gathered since the last log step."""
    state = training.state
    epoch = training.checkpoints.position.epoch(state)
    training.telemetry.log(step, state, lr, loss_scale(training.scaler), epoch)


@dataclass(frozen=True)
class StepDue:
    """What an optimizer step must do besides its update. Every rank decides the same."""

    log: bool
    evaluate: bool
    save: bool
    signum: int  # a stop signal that some rank received, else 0
    last: bool

    @staticmethod
    def logs(cfg, step: int, last_step: int) -> bool:
        return step % cfg.logging_steps == 0 or step >= last_step  # a short run still shows its curves

    @classmethod
    def after(cls, training: Training, step: int, last_step: int) -> StepDue:
        cfg = training.cfg
        evaluate_now = evaluates_during_training(cfg, step, training.total_steps)
        return cls(
            log=cls.logs(cfg, step, last_step),
            evaluate=evaluate_now,
            # The best model is loaded from a checkpoint at the end, so each evaluation gets one.
            save=bool(cfg.save_steps and step % cfg.save_steps == 0) or (evaluate_now and cfg.load_best_model_at_end),
            signum=training.stop.agreed(),  # collective
            last=step >= last_step,
        )


def on_alarm(training: Training, ledger: StepLedger, step: int) -> bool:
    """Report the loss-scale alarm, then stop, warn or fall back as --on_scale_collapse says.

    Returns:
        True when the run fell back to its last checkpoint in another precision: the loop carries on from there.
    """
    training.accelerator.print(ledger.alarm)
    training.report_overflow(*ledger.replay, step)  # the alarm's step's last micro-batch, as that step ran it
    # Read one step late, the alarm's step may be the one before this: say so where the checkpoint's number differs.
    late = (
        f" (after step {step}: step {ledger.alarm_step}'s overflow is read during the next step, which ran too)"
        if ledger.alarm_step != step
        else ""
    )
    if training.cfg.on_scale_collapse == "stop":
        with training.telemetry.paused():
            path = training.save_checkpoint()
        raise TrainingHalted(
            f"stopped by the loss-scale alarm; checkpoint for inspection: {path}{late}", NUMERIC_FAULT_EXIT_CODE
        )
    ledger.alarm = None  # warned; the watch fires again only after a new run of skips
    if training.cfg.on_scale_collapse == "fallback":
        plan = fallback.fall_back(training.policy, training.checkpoints.last_saved, step)
        training.accelerator.print(training.fall_back(plan))
        return True
    return False


def train(training: Training, budget: int | None = None) -> None:
    """Train until `training.total_steps` optimizer steps, or `budget` more of them (a benchmark's segment).

    `training.state` is updated in place.

    Raises:
        TrainingHalted: on a loss-scale alarm (after checkpointing), a numeric fault, or an agreed stop signal.
    """
    cfg, accelerator, state, telemetry = training.cfg, training.accelerator, training.state, training.telemetry
    model = training.model
    last_step = training.total_steps if budget is None else min(training.total_steps, state.opt_step + budget)
    ledger, loss_watch = StepLedger(training), LossWatch(accelerator)
    best = BestModel(cfg, state)
    if best.out_of_patience():  # resumed from the checkpoint of the evaluation that stopped the run
        last_step = state.opt_step
    first_step = state.opt_step + 1  # of this call: after a resume, warm-up happens again
    if state.opt_step == 0 and not cfg.skip_amp_preflight:
        training.preflight()
    if state.opt_step == 0 and cfg.eval_on_start:  # the starting point; its loader draws no random number of training's
        with diagnose.rng_untouched():
            telemetry.log_eval(0, training.evaluate())
    falls_back = cfg.on_scale_collapse == "fallback" and training.policy.scaler_enabled  # a loss scale to collapse
    if falls_back and training.checkpoints.last_saved is None:
        training.save_checkpoint()  # the start: where a fallback comes back to (amp/fallback.py)
    model.train()
    steps = optimizer_steps(training)
    while state.opt_step < last_step:
        # ---- the micro-batches of one optimizer step -----------------------------------------------------------------
        micro_batches = next(steps)
        items = [training.inputs.task.items(batch) for batch in micro_batches]  # host values: no sync
        weights = step_weights(items, training.host, accelerator.num_processes)
        for i, (batch, count, weight) in enumerate(zip(micro_batches, items, weights)):
            # Gradients are reduced over the ranks once per optimizer step, on its last micro-batch.
            last = i == len(micro_batches) - 1
            # amp/headroom_bits: hooks on a log step's last micro-batch only
            probe = last and StepDue.logs(cfg, state.opt_step + 1, last_step)
            with contextlib.nullcontext() if last else accelerator.no_sync(model):
                # dropout_masks: faster dropout masks on CPUs where torch draws them serially (host/dropout.py)
                with training.policy.autocast(), training.dropout_masks(), telemetry.headroom.armed(model, probe):
                    loss = training.loss(batch)
                accelerator.backward(training.scaler.scale(loss * weight))
            state.batches_in_epoch += 1
            telemetry.add_micro_batch(loss, count, batch)

        # ---- the optimizer step --------------------------------------------------------------------------------------
        grad_norm, lr = optimizer_step(training, ledger, (batch, weight))
        state.take_step(training.policy.mode)  # the precision it ran in, for the summary and the model card
        step = state.opt_step
        loss_watch.after_step(telemetry.step_loss, ledger.overflow.on_device)
        telemetry.add_optimizer_step(grad_norm)
        if step == first_step:
            telemetry.restart_clock()  # the first step warms up (allocations, compilation): not throughput

        # ---- what the step must do besides the update ------------------------------------------------------------
        due = StepDue.after(training, step, last_step)
        if due.log or due.evaluate or due.save or due.signum or due.last or ledger.alarm:
            ledger.settle()  # this step's outcome is needed now: a host sync, at these steps only
            try:
                loss_watch.check(step, training.checkpoints.last_saved)  # no log, eval or save past a non-finite loss
            except TrainingHalted:
                training.report_overflow(*ledger.captured(), step)  # this step's, settled above
                raise
        logged = due.log or ledger.alarm  # on_alarm may clear the alarm below
        if logged:
            log_step(training, step, lr)
        if ledger.alarm and on_alarm(training, ledger, step):
            ledger, loss_watch = StepLedger(training), LossWatch(accelerator)  # for the new scaler
            first_step = state.opt_step + 1
            steps = optimizer_steps(training)  # on from the checkpoint's data position
            continue
        if due.evaluate:
            with telemetry.paused():
                metrics = training.evaluate_and_log()
            stopped_early = best.after_eval(step, metrics)
            if stopped_early and step < training.total_steps:  # settled above, as every evaluating step is
                if not logged:  # a run's last step is always logged: its curves end where it ended
                    log_step(training, step, lr)
                telemetry.writer.log({TRAIN_STOPPED_EARLY: 1.0}, step)
                accelerator.print(stopped_early)
                last_step = step
        if due.save:
            with telemetry.paused():
                training.save_checkpoint()
        if due.signum:
            path = training.save_checkpoint()
            raise TrainingHalted(
                f"stopped by signal {due.signum} at optimizer step {step}; resume from {path}",
                training.stop.exit_code(due.signum),
            )
