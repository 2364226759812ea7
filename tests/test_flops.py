"""MFU's inputs: the FLOPs per token of the model that trains, found under DDP's wrapper too, and the GPU's peak from
its name as CUDA gives it. No GPU runs here: the peak is read from names, the FLOPs from models on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from app.telemetry.flops import flops_per_token, peak_tflops
from tests.conftest import free_port


@pytest.mark.parametrize(
    "name, mode, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "fp16", 756.0),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156.0),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla T4", "fp32", 8.1),
        ("NVIDIA L4", "fp16", 121.0),
        ("NVIDIA L40S", "fp16", 362.1),
        ("NVIDIA L40", "fp16", None),  # not an L4: a quarter of its peak would make its MFU 1.5x too high
        ("NVIDIA H100 NVL", "fp16", None),  # not the SXM card's figures
        ("NVIDIA H200 NVL", "bf16", None),
        ("NVIDIA GH200 480GB", "bf16", 989.4),
        ("Tesla T4", "bf16", None),  # no bf16 tensor cores
        ("NVIDIA GeForce RTX 4090", "fp16", None),
    ],
)
def test_a_gpus_peak_is_found_by_the_words_of_its_name(name, mode, tflops):
    assert peak_tflops(name, mode) == (tflops * 1e12 if tflops else None)


@pytest.fixture
def one_process_group():
    """A process group of one on the CPU (gloo), as under `accelerate launch` with DDP, closed afterwards."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_flops_per_token_reads_the_model_inside_ddps_wrapper(one_process_group):
    """DDP's wrapper has no config: perf/mfu_pct and its chart were missing from every multi-GPU run."""
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    model = LlamaForCausalLM(config)
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    bare, seen = flops_per_token(model), flops_per_token(wrapped)
    assert bare is not None and seen is not None and seen(128) == bare(128)
