"""The training loop: one function for fp32, fp16 and bf16, a small optimizer-step helper, and evaluation.

There is no `if amp:` here. `policy.autocast()` and the scaler are called the same way in every mode; with AMP off
they are exact no-ops. Host syncs per optimizer step, between log steps: none with AMP off, and none with fp16 on a fused optimizer, which
skips overflowed updates on the device while the overflow flag travels to the host without blocking; the loss scale
is read on skipped steps only. Everything else is read at log, checkpoint and stop steps.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
import torch.nn.functional as F
from accelerate import Accelerator, skip_first_batches

from app import metrics
from app.checkpoint import Checkpoints
from app.config import TrainConfig
from app.errors import NUMERIC_FAULT_EXIT_CODE, TrainingHalted
from app.guards import LossWatch, ScaleWatch
from app.optim import build_optimizer, build_schedule, total_optimizer_steps
from app.precision import OverflowFlag, PrecisionPolicy
from app.preemption import StopRequest
from app.runtime import backend_name
from app.state import TrainState


@dataclass
class Trainables:
    """What the loop drives, already passed through `accelerator.prepare` (the schedule is not: see optim.py)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    train_loader: torch.utils.data.DataLoader
    eval_loader: torch.utils.data.DataLoader


def build_trainables(cfg: TrainConfig, accelerator: Accelerator, policy: PrecisionPolicy, model: torch.nn.Module,
                     train_loader, eval_loader) -> tuple[Trainables, int]:
    """Compile (if asked), prepare, and add the schedule and the scaler. Returns the parts and the total steps."""
    if cfg.torch_compile:
        # The model only: autocast and the scaler stay eager. In place, so that no wrapper module prefixes the
        # parameter names ("_orig_mod.") in checkpoints and in the saved model.
        model.compile()
    optimizer = build_optimizer(model, cfg)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    total_steps = total_optimizer_steps(cfg, len(train_loader))
    # Not prepared: a prepared schedule would step once per process, and even on skipped steps. Built on the raw
    # optimizer, the one the scaler steps (see optimizer_step), which shares its param groups with the wrapper.
    schedule = build_schedule(optimizer.optimizer, cfg, total_steps)
    scaler = policy.make_scaler(cfg.init_loss_scale, cfg.loss_scale_growth_interval, backend_name(accelerator))
    return Trainables(model, optimizer, schedule, scaler, train_loader, eval_loader), total_steps


class StepLedger:
    """Settles each optimizer step as applied or skipped once its overflow flag is on the host, and moves the LR on.

    A step is normally settled one step late, when its flag has long landed (see precision.OverflowFlag), and still
    before the next update, so the LR follows applied updates exactly. At log, checkpoint and stop points the loop
    settles the current step at once: the one host sync of those steps.
    """

    def __init__(self, state: TrainState, parts: Trainables, scale_watch: ScaleWatch, device: torch.device):
        self.state, self.parts, self.scale_watch = state, parts, scale_watch
        self.overflow = OverflowFlag(parts.scaler, device)
        self.alarm: str | None = None  # the loss-scale alarm's diagnostic, once it fires

    def settle(self) -> None:
        skipped = self.overflow.read()
        if skipped is None:
            return
        self.state.record_outcome(skipped)
        if not skipped:
            self.parts.schedule.step()
        self.alarm = self.alarm or self.scale_watch.after_step(self.state, skipped, self.parts.scaler)


def optimizer_step(accelerator: Accelerator, parts: Trainables, max_grad_norm: float, ledger: StepLedger) -> torch.Tensor:
    """Unscale, clip, step, update, zero the gradients. Returns the unscaled gradient norm (inf/NaN on overflow)."""
    # The raw optimizer: the scaler hands a fused one the overflow flag, which Accelerate's wrapper would not pass on.
    optimizer = parts.optimizer.optimizer
    parts.scaler.unscale_(optimizer)
    # With clipping off, the norm is still computed (for telemetry); an infinite bound leaves the gradients as they are.
    grad_norm = accelerator.clip_grad_norm_(parts.model.parameters(), max_grad_norm or float("inf"))
    ledger.settle()  # the previous step, whose flag landed long ago: sets the LR this update uses
    ledger.overflow.capture(optimizer)
    parts.scaler.step(optimizer)
    parts.scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)
    return grad_norm


def train(
    cfg: TrainConfig,
    accelerator: Accelerator,
    policy: PrecisionPolicy,
    parts: Trainables,
    state: TrainState,
    total_steps: int,
    telemetry: metrics.Telemetry,
    checkpoints: Checkpoints,
    stop: StopRequest,
) -> None:
    """Train from `state` until it reaches `total_steps` optimizer steps; `state` is updated in place.

    Raises:
        TrainingHalted: on a loss-scale alarm (after checkpointing), a numeric fault, or an agreed stop signal.
    """
    model, scaler = parts.model, parts.scaler
    ledger = StepLedger(state, parts, ScaleWatch(cfg.min_loss_scale, cfg.max_consecutive_skips), accelerator.device)
    loss_watch = LossWatch(accelerator)
    batches_per_epoch = len(parts.train_loader)
    first_step = state.opt_step + 1  # of this process: after a resume, warm-up happens again
    model.train()
    while state.opt_step < total_steps:
        parts.train_loader.set_epoch(state.epoch)
        # On resume, skip what this epoch already consumed: the seedable sampler replays the same order.
        batches = skip_first_batches(parts.train_loader, state.batches_in_epoch) if state.batches_in_epoch else parts.train_loader
        for batch in batches:
            with accelerator.accumulate(model):
                with policy.autocast():
                    loss = model(**batch).loss
                accelerator.backward(scaler.scale(loss))
            state.micro_step += 1
            state.batches_in_epoch += 1
            telemetry.add_micro_batch(loss, batch)
            loss_watch.add_micro_loss(loss)
            if not accelerator.sync_gradients:
                continue  # still accumulating: no optimizer step on this micro-batch

            grad_norm = optimizer_step(accelerator, parts, cfg.max_grad_norm, ledger)
            state.opt_step += 1
            step = state.opt_step
            telemetry.add_optimizer_step(grad_norm)
            loss_watch.after_step(ledger.overflow.on_device)
            if step == first_step:
                telemetry.restart_clock()  # the first step warms up (allocations, compilation): not throughput

            log_due = step % cfg.logging_steps == 0
            save_due = cfg.save_steps and step % cfg.save_steps == 0
            signum = stop.agreed()
            if log_due or save_due or signum or ledger.alarm or step >= total_steps:
                ledger.settle()  # this step's outcome is needed now: a host sync, at these steps only
                loss_watch.check(step, checkpoints.last_saved)  # never log or save past a non-finite loss
            if log_due or ledger.alarm:
                telemetry.log(step, state, parts.schedule.get_last_lr()[0], scaler.get_scale(),
                              state.epoch + state.batches_in_epoch / batches_per_epoch)
            if ledger.alarm:
                accelerator.print(ledger.alarm)
                if cfg.on_scale_collapse == "stop":
                    with telemetry.paused():
                        path = checkpoints.save(state)
                    raise TrainingHalted(f"stopped by the loss-scale alarm; checkpoint for inspection: {path}", NUMERIC_FAULT_EXIT_CODE)
                ledger.alarm = None  # warned; the watch fires again only after a new run of skips
            if cfg.eval_steps and step % cfg.eval_steps == 0 and step < total_steps:
                with telemetry.paused():
                    telemetry.log_eval(step, evaluate(accelerator, policy, model, parts.eval_loader))
            if save_due:
                with telemetry.paused():
                    checkpoints.save(state)
            if signum:
                path = checkpoints.save(state)
                raise TrainingHalted(f"stopped by signal {signum} at optimizer step {step}; resume from {path}",
                                     stop.exit_code(signum))
            if step >= total_steps:
                break
        else:
            state.epoch += 1
            state.batches_in_epoch = 0


@torch.no_grad()
def evaluate(accelerator: Accelerator, policy: PrecisionPolicy, model: torch.nn.Module, loader) -> dict[str, float]:
    """Loss, accuracy and macro-F1 over the whole validation set, gathered from every rank without duplicates."""
    model.eval()
    losses, predictions, references = [], [], []
    for batch in loader:
        with policy.autocast():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        per_example = F.cross_entropy(logits.float(), batch["labels"], reduction="none")
        gathered = accelerator.gather_for_metrics((per_example, logits.argmax(dim=-1), batch["labels"]))
        for store, values in zip((losses, predictions, references), gathered):
            store.append(values)
    model.train()
    loss, predicted, labels = (torch.cat(values).cpu() for values in (losses, predictions, references))
    return {
        metrics.EVAL_LOSS: loss.mean().item(),
        metrics.EVAL_ACCURACY: (predicted == labels).float().mean().item(),
        metrics.EVAL_F1: macro_f1(predicted, labels),
    }


def macro_f1(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    """F1 averaged over the classes that occur in the labels or the predictions (as sklearn's average="macro")."""
    scores = []
    for cls in torch.unique(torch.cat([predicted, labels])):
        true_pos = ((predicted == cls) & (labels == cls)).sum()
        errors = (predicted == cls).sum() + (labels == cls).sum() - 2 * true_pos  # false positives + false negatives
        scores.append(2 * true_pos / (2 * true_pos + errors))
    return torch.stack(scores).mean().item()
