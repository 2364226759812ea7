"""The loss scaler: built for the backend, checkpointed whether it is on or off, and its overflow flag brought to the
host without stalling the device."""

from __future__ import annotations

import torch

from app.amp.policy import PrecisionPolicy


def make_scaler(policy: PrecisionPolicy, init_scale: float, growth_interval: int, backend: str) -> torch.amp.GradScaler:
    """The loss scaler for this policy and backend, built the same way whether it is on or off.

    Args:
        init_scale: the first loss scale.
        growth_interval: clean steps before the scale doubles.
        backend: as runtime.backend_name says. Under FSDP1 each rank holds a shard of the gradients, and only
            ShardedGradScaler makes the ranks agree on an overflow; DDP reduces gradients before unscaling and
            FSDP2's DTensors reduce the overflow flag, so the plain scaler is right for them.
    """
    options = dict(init_scale=init_scale, growth_interval=growth_interval, enabled=policy.scaler_enabled)
    if backend == "FSDP1":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(policy.device_type, **options)
    return torch.amp.GradScaler(policy.device_type, **options)


def loss_scale(scaler: torch.amp.GradScaler) -> float | None:
    """The current scale (a host read), or None with loss scaling off: telemetry then leaves the scaler's tags out."""
    return scaler.get_scale() if scaler.is_enabled() else None


class ScalerCheckpoint:
    """The loss scaler as Accelerate checkpoints it: registered whether AMP is on or off, and safe to toggle.

    A disabled GradScaler saves `{}`, and an enabled one refuses to load that; so the enabled flag is saved alongside,
    and a resume that toggles loss scaling starts a fresh scaler and says so (see `toggled`). Accelerate knows custom
    objects by their position, so a precision fallback swaps the scaler inside this object, never the object.
    """

    def __init__(self, scaler: torch.amp.GradScaler):
        self.scaler = scaler
        self.toggled: str | None = None  # "on -> off" or "off -> on" after a load that toggled loss scaling

    def state_dict(self) -> dict:
        return {"enabled": self.scaler.is_enabled(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, saved: dict) -> None:
        enabled = self.scaler.is_enabled()
        if saved["enabled"] != enabled:
            self.toggled = f"{'on' if saved['enabled'] else 'off'} -> {'on' if enabled else 'off'}"
            return
        self.scaler.load_state_dict(saved["scaler"])


class OverflowFlag:
    """Whether the scaler skipped an update, brought to the host without stalling the device.

    With a fused optimizer, `scaler.step` makes no host sync of its own (see the loop's docstring): the kernel skips an
    overflowed update on the device. The flag is copied without blocking and read one optimizer step later, when the
    copy has long landed. With loss scaling off nothing is copied: every update counts as applied.
    """

    def __init__(self, scaler: torch.amp.GradScaler, device: torch.device):
        self._scaler = scaler
        on_gpu = device.type == "cuda"
        self._host = torch.zeros((), dtype=torch.bool, pin_memory=on_gpu)
        self._landed = torch.cuda.Event() if on_gpu else None
        self.on_device = torch.zeros((), dtype=torch.bool, device=device)  # the latest step's flag, for device-side use
        self._scale_used: torch.Tensor | None = None  # the latest step's loss scale, on the device
        self._pending = False

    def capture(self, optimizer: torch.optim.Optimizer) -> None:
        """Start this step's flag on its way. Call after `scaler.unscale_(optimizer)`, before `scaler.step`."""
        self._pending = True
        if not self._scaler.is_enabled():
            return
        # The scaler keeps its per-device flags privately; its public get_scale() would sync.
        flags = self._scaler._found_inf_per_device(optimizer).values()  # noqa: SLF001
        scale = self._scaler._scale  # noqa: SLF001  (update() changes it in place: copied, on the device)
        self._scale_used = scale.clone() if self._scale_used is None else self._scale_used.copy_(scale)
        self.on_device = sum(flag.sum() for flag in flags) > 0  # ShardedGradScaler keeps shape [1], GradScaler []
        self._host.copy_(self.on_device, non_blocking=True)
        if self._landed is not None:
            self._landed.record()

    def scale_used(self) -> float:
        """The loss scale of the latest captured step, before update() moved it on (host sync: for reports only)."""
        return float(self._scale_used) if self._scale_used is not None else self._scaler.get_scale()

    def read(self) -> bool | None:
        """The captured step's flag (None if none is pending). Waits for the copy only, never for later work."""
        if not self._pending:
            return None
        if self._landed is not None:
            self._landed.synchronize()
        self._pending = False
        return bool(self._host) and self._scaler.is_enabled()
