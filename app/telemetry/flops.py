"""The model FLOPs utilisation (MFU) inputs: training FLOPs per token, and the GPU's dense peak for a precision."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from accelerate.utils import extract_model_from_parallel

from app.host.runtime import tf32_matmuls
from app.tasks.first_token import cut_layer, weights_once_per_sequence

# Dense peak TFLOPS per GPU from the vendors' datasheets, by the words of the device name (the first entry whose words
# are all in it): "NVIDIA L40" is not an L4, "NVIDIA H100 NVL" not the SXM H100 (a variant without figures here: no
# MFU rather than a wrong one). fp32 without TF32 runs on CUDA cores; "tf32" where host/runtime.tf32_matmuls says so.
PEAK_TFLOPS: list[tuple[str, dict[str, float] | None]] = [
    ("H200 NVL", None),
    ("H200", {"fp16": 989.4, "bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("GH200", {"fp16": 989.4, "bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # its GPU is the H100/H200 SXM's
    ("H100 NVL", None),
    ("H100 PCIe", {"fp16": 756.0, "bf16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"fp16": 989.4, "bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"fp16": 312.0, "bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"fp16": 362.1, "bf16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"fp16": 121.0, "bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
]


def peak_flops(device: torch.device, mode: str) -> float | None:
    """The device's dense peak FLOP/s for the precision that runs its matmuls, or None where unknown (CPUs)."""
    if device.type != "cuda":
        return None
    if mode == "no":
        mode = "tf32" if tf32_matmuls() else "fp32"
    return peak_tflops(torch.cuda.get_device_name(device), mode)


def peak_tflops(device_name: str, mode: str) -> float | None:
    """The dense peak FLOP/s of the GPU named `device_name` (as CUDA names it) in `mode`, or None where not listed."""
    words = set(device_name.replace("-", " ").upper().split())
    for key, table in PEAK_TFLOPS:
        if set(key.upper().split()) <= words:
            return table[mode] * 1e12 if table and mode in table else None
    return None


@dataclass(frozen=True)
class TrainingFlops:
    """A training step's FLOPs: per token through the model's body (a function of the sequence length), and per
    position that its LM head computes logits at."""

    per_token: Callable[[float], float]
    per_head_position: float = 0.0

    def of(self, tokens: int, sequences: int, head_positions: int) -> float:
        """The FLOPs of `tokens` (padding included) in `sequences`, with the LM head at `head_positions`."""
        return self.per_token(tokens / max(sequences, 1)) * tokens + self.per_head_position * head_positions


def head_positions(batch: dict) -> int:
    """The positions a batch has its LM head compute: the causal-LM collator's `logit_positions` (tasks/lm_data.py),
    its fillers included; none for a batch without (a classifier, which has no LM head)."""
    positions = batch.get("logit_positions")
    return 0 if positions is None else positions.numel()  # a tensor's shape: no host sync


def matmul_flops(weights: Iterable[torch.nn.Parameter]) -> int:
    """Training FLOPs per row through these weights: 2 per weight forward, 2 for the input's gradient, and 2 for the
    weight's own gradient where it trains (a frozen base's weights have none: 4, not 6)."""
    return sum((6 if weight.requires_grad else 4) * weight.numel() for weight in weights)


def training_flops(model: torch.nn.Module) -> TrainingFlops | None:
    """Training FLOPs: per token, each matmul weight's (matmul_flops) plus attention; per head position, the LM head's.

    A decoder's attention is causal: its kernels compute half the scores of an encoder's. The LM head counts where it
    runs, tied to the embeddings or not (as nanoGPT and PaLM count it): the causal-LM task computes it at the labelled
    positions only, every position of packed text, a small share of a prompt/response batch.
    """
    model = extract_model_from_parallel(model)  # DDP's wrapper has no config: no MFU on any multi-GPU run
    config = getattr(model, "config", None)
    layers, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if not (layers and hidden):
        return None
    # peft's copy of a module to train in full (--lora_modules_to_save) keeps the module it copied, which runs no more;
    # its weights are idle unless another module shares them (a head tied to a copied embedding still runs on them).
    running = {
        id(p) for name, p in model.named_parameters(remove_duplicate=False) if ".original_module." not in f".{name}."
    }
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    copied = getattr(output, "modules_to_save", None)  # a head copied to train in full: the copy runs
    output = copied if copied is not None else output
    head = {id(p): p for p in output.parameters()} if output is not None else {}
    lookups = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    idle = {id(p) for p in model.parameters()} - running
    apart = lookups | head.keys() | idle  # lookups cost no FLOPs; a tied head's weight is an embedding's
    body = matmul_flops(p for p in model.parameters() if id(p) not in apart)
    causal = type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))
    attention = 6 if causal else 12
    per_head_position = matmul_flops(head.values())
    # A classifier's last layer that computes the first token alone (tasks/first_token.py): its query, attention
    # output and feed-forward weights, and its attention, once per sequence rather than once per token.
    cut = cut_layer(model)
    if cut is None:
        return TrainingFlops(lambda seq_len: body + attention * layers * hidden * seq_len, per_head_position)
    once = matmul_flops(weights_once_per_sequence(cut))
    return TrainingFlops(
        lambda seq_len: body - once + once / seq_len + attention * ((layers - 1) * seq_len + 1) * hidden,
        per_head_position,
    )
