"""What a run's weights, gradients and optimizer state take, estimated before any weight loads and said in one line.

From the model built on the meta device (no memory) and what will train: frozen parameters in the base's storage
dtype, trainable ones in float32 (master weights), a float32 gradient per trainable parameter, and AdamW's two float32
moments per trainable parameter. Activations, the data and the framework itself come on top: the summary at the end
puts the measured peak beside this estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADAMW_STATES = 2  # exp_avg and exp_avg_sq, float32 each
FP32_BYTES = 4


def size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Footprint:
    frozen: int  # parameters that do not train, in the base's storage dtype
    frozen_dtype: torch.dtype
    trainable: int  # float32

    @property
    def weight_bytes(self) -> int:
        return self.frozen * self.frozen_dtype.itemsize + self.trainable * FP32_BYTES

    @property
    def gradient_bytes(self) -> int:
        return self.trainable * FP32_BYTES

    @property
    def optimizer_bytes(self) -> int:
        return self.trainable * FP32_BYTES * ADAMW_STATES

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes

    def line(self) -> str:
        dtype = str(self.frozen_dtype).removeprefix("torch.")
        frozen = f"{size(self.frozen * self.frozen_dtype.itemsize)} frozen in {dtype}, " if self.frozen else ""
        return (
            f"memory, estimated before loading: weights {size(self.weight_bytes)} ({frozen}"
            f"{size(self.trainable * FP32_BYTES)} trained in float32), gradients {size(self.gradient_bytes)}, AdamW "
            f"state {size(self.optimizer_bytes)}: {size(self.total_bytes)} before activations"
        )
