"""The runtime: Accelerate never autocasts behind the app's back, and the backend it runs is named right."""

from __future__ import annotations

import os

import pytest
import torch
import yaml
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from app.amp.policy import launcher_choice, resolve_precision
from app.amp.scaler import make_scaler
from app.config import TrainConfig, parse_config
from app.errors import UsageError
from app.host.device import device_type, launched_on_cpu
from app.host.runtime import (
    another_process_ended,
    backend_name,
    build_accelerator,
    tf32_convolutions,
    tf32_matmuls,
)
from tests.conftest import clean_env, run_app
from tests.harness import build_training, train

GLOO = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/{}] {}. This is typically caused by a remote worker"


@pytest.mark.parametrize(
    "error, ended",
    [
        (RuntimeError(GLOO.format("pair.cc:537", "Read error [127.0.0.1]:3989: Connection reset by peer")), True),
        (RuntimeError(GLOO.format("pair.cc:590", "Connection closed by peer [127.0.0.1]:23456")), True),
        (torch.distributed.DistBackendError("NCCL communicator was aborted"), True),
        # A hang is not a process gone, nor is this process's own error whatever its words: their tracebacks stay.
        (RuntimeError(GLOO.format("unbound_buffer.cc:81", "Timed out waiting 1800000ms for recv operation")), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (torch.distributed.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:3356, invalid usage"), False),
        (torch.distributed.DistBackendError("NCCL error: unhandled cuda error, out of memory"), False),
        (ConnectionResetError(104, "Connection reset by peer"), False),
    ],
)
def test_only_a_collective_failed_by_a_process_gone_counts_as_another_process_ended(error, ended):
    assert another_process_ended(error) is ended


@pytest.mark.parametrize("launcher", ["bf16", "fp16"])
def test_a_launcher_precision_never_reaches_accelerate(tiny_model_dir, review_files, monkeypatch, launcher):
    """`accelerate launch --mixed_precision bf16 app/train.py --mixed_precision no` must run fp32.

    The launcher's choice reaches the script only as this variable; an Accelerator built without
    mixed_precision="no" would read it and wrap the prepared model's forward in its own (real, on CPU) bf16 autocast.
    """
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    run = build_training(tiny_model_dir, review_files, mixed_precision="no", max_steps=2)
    dtypes = set()
    for module in run.model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, i, output: dtypes.add(output.dtype))
    train(run)
    assert dtypes == {torch.float32}
    assert run.accelerator.mixed_precision == "no"  # on a CPU Accelerate ignores fp16, but would still report it


# On a CPU, Accelerate never switches to FSDP (it runs DDP; see test_backends.py), so the accelerator's state is set
# here as Accelerate's own AcceleratorState sets it on GPUs: distributed_type FSDP and the FSDP plugin of the config.
@pytest.mark.parametrize("version, name, scaler", [(1, "FSDP1", "ShardedGradScaler"), (2, "FSDP2", "GradScaler")])
def test_fsdp1_and_fsdp2_are_told_apart_and_get_their_scaler(version, name, scaler):
    accelerator = build_accelerator(TrainConfig())
    assert backend_name(accelerator) == "single process"
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=version)
    accelerator.state.distributed_type = DistributedType.FSDP
    assert backend_name(accelerator) == name
    policy, _ = resolve_precision(True, None, "cpu", launcher=None)
    assert type(make_scaler(policy, 1024.0, 2000, backend=backend_name(accelerator))).__name__ == scaler


def test_the_cpu_suite_sees_no_gpu(tmp_path):
    """On a GPU host too, the suite runs as on a CPU host: in this process and in every child it starts."""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and clean_env(tmp_path)["CUDA_VISIBLE_DEVICES"] == ""
    assert not torch.cuda.is_available() and device_type() == "cpu"


@pytest.mark.parametrize("value, on_cpu", [(None, False), ("1", True), ("true", True), ("YES", True), ("0", False)])
def test_a_launch_on_the_cpu_is_read_as_accelerate_reads_it(monkeypatch, value, on_cpu):
    """`accelerate launch --cpu` (a config's use_cpu: true) on a GPU host: Accelerate trains on the CPU, so autocast and
    the scaler must be the CPU's (device_type reads this before any Accelerator exists)."""
    if value is None:
        monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    else:
        monkeypatch.setenv("ACCELERATE_USE_CPU", value)
    assert launched_on_cpu() is on_cpu


def test_a_launch_on_the_cpu_that_is_neither_yes_nor_no_is_one_line(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "maybe")
    with pytest.raises(UsageError, match="ACCELERATE_USE_CPU='maybe' is neither yes nor no"):
        device_type()


NEW_TF32_API = hasattr(torch.backends.cudnn, "conv")  # torch 2.9+'s fp32_precision settings


@pytest.fixture
def tf32_set_through_torchs_new_api():
    """CUDA's fp32 matmuls in TF32 through torch 2.9+'s setting (a setting only: this CPU runs no CUDA matmul); torch's
    older allow_tf32 and get_float32_matmul_precision() raise from then on."""
    if not NEW_TF32_API:
        pytest.skip("torch before 2.9 has only the allow_tf32 flags")
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    matmul.fp32_precision, conv.fp32_precision = "tf32", "ieee"
    yield
    matmul.fp32_precision, conv.fp32_precision = before


def test_tf32_settings_are_read_where_torchs_older_flags_raise(tf32_set_through_torchs_new_api):
    with pytest.raises(RuntimeError, match="legacy and new APIs"):
        torch.get_float32_matmul_precision()  # what run/tf32 read: the run stopped at start
    assert tf32_matmuls() and not tf32_convolutions()


def test_tf32_settings_by_default_are_torchs():
    assert not tf32_matmuls() and tf32_convolutions()  # torch's defaults, as its docs give them


@pytest.fixture
def cudnn_tf32_turned_off_the_old_way():
    before = torch.backends.cudnn.conv.fp32_precision if NEW_TF32_API else None
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = True
    if NEW_TF32_API:
        torch.backends.cudnn.conv.fp32_precision = before


def test_tf32_convolutions_turned_off_through_allow_tf32_read_as_off(cudnn_tf32_turned_off_the_old_way):
    # torch 2.9+ reads it back as fp32_precision "none", which was taken for TF32: run/tf32 said TF32 where it was off
    assert not tf32_convolutions()


@pytest.mark.parametrize(
    "launcher, flags, recorded",
    [("fp16", [], "fp16"), ("bf16", ["--mixed_precision", "no"], "no"), ("no", ["--amp"], "fp16")],
)
def test_training_args_yaml_records_the_precision_that_ran(
    tmp_path, quick_args, monkeypatch, launcher, flags, recorded
):
    # It recorded `mixed_precision: null` for the launcher's choice: read back with --config, the run would take
    # whatever another launcher or CPU picks.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    assert run_app([*quick_args, *flags, "--max_steps", "1", "--eval_steps", "0"]) == 0
    for folder in (tmp_path / "out", tmp_path / "runs" / "test"):
        saved = yaml.safe_load((folder / "training_args.yaml").read_text())
        assert (saved["mixed_precision"], saved["amp"]) == (recorded, False), folder
    # Read back, it runs the same precision under any launcher (amp: true beside another mode would be refused).
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16" if recorded != "bf16" else "no")
    cfg = parse_config(["--config", str(tmp_path / "out" / "training_args.yaml")])
    assert resolve_precision(cfg.amp, cfg.mixed_precision, "cpu", launcher_choice())[0].mode == recorded


def test_a_rank_that_does_not_say_why_gives_rank_0_time_to_say_it(monkeypatch, capsys):
    # Bad input stops both ranks of a launch before they share a process group; rank 1 exited at once, and torchrun at
    # times stopped rank 0 before its line: no error line at all (1 launch in 10).
    import time

    import app.cli
    from app.cli import say_why
    from app.errors import UsageError

    monkeypatch.setattr(app.cli, "QUIET_RANKS_WAIT_S", 0.3)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, waits, says in (("1", True, False), ("0", False, True)):
        monkeypatch.setenv("RANK", rank)
        started = time.perf_counter()
        say_why(UsageError("--learning_rate must be above 0, got -1"))
        assert (time.perf_counter() - started >= 0.3) == waits
        assert (capsys.readouterr().err == "error: --learning_rate must be above 0, got -1\n") == says
