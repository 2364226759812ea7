"""The runtime: the Accelerator, seeding, printing on the main process, and what actually runs.

Accelerate owns processes, devices, data sharding and gathering. It never owns precision here: the Accelerator is
built with `mixed_precision="no"` whatever the launcher says, and amp/policy.py reads the launcher's choice.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import (
    DistributedType,
    GradientAccumulationPlugin,
    broadcast_object_list,
    parse_flag_from_env,
    set_seed,
)

from app.amp.policy import cpu_model, launched_by_accelerate
from app.config import TrainConfig
from app.errors import ProcessLost, UsageError, counted, first_line
from app.host.device import device_type, launched_world_size


def pinned_batches() -> bool:
    """Batches come from pinned memory and reach the GPU without blocking: a blocking copy is a host sync."""
    return device_type() == "cuda"


def build_accelerator(cfg: TrainConfig) -> Accelerator:
    """The Accelerator for this run, after checking that the launched processes really form one job."""
    refuse_launcher_accumulation(cfg.gradient_accumulation_steps)
    accelerator = connect_accelerator(
        # A fixed shuffle order per (seed, epoch), the same on every rank: the basis of an exact resume.
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=cfg.seed, non_blocking=pinned_batches()
        ),
    )
    set_seed(cfg.seed)
    return accelerator


LAUNCHER_ACCUMULATION = "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"  # accelerate launch --gradient_accumulation_steps


def refuse_launcher_accumulation(steps: int) -> None:
    """ACCELERATE_GRADIENT_ACCUMULATION_STEPS (a DeepSpeed launch config's gradient_accumulation_steps, or the
    environment) is not read: the loop accumulates by the app's flag, and another number would be ignored without a
    word. UsageError naming both."""
    launched = os.environ.get(LAUNCHER_ACCUMULATION)
    if launched is None or (launched.strip().isdigit() and int(launched) == steps):  # "02" is 2, as Accelerate reads
        return
    raise UsageError(
        f"{LAUNCHER_ACCUMULATION}={launched} (from the launch config or the environment) is not read here: the app "
        f"accumulates by its own --gradient_accumulation_steps, {steps}; make the two equal, or unset the variable"
    )


def connect_accelerator(**options) -> Accelerator:
    """An Accelerator with `options` that leaves precision to the app, once the launched processes form one job."""
    # Said only if the others are slow to come: processes started by hand (as srun does) connect at once.
    note = unlaunched_world_note()
    waiting = threading.Timer(UNLAUNCHED_WAIT_S, print, [note], {"file": sys.stderr, "flush": True})
    waiting.daemon = True
    if note:
        waiting.start()  # cancel() below is a no-op on a timer never started
    try:
        accelerator = Accelerator(
            # The app autocasts and scales itself; Accelerate's AMP would override our autocast and scale again.
            mixed_precision="no",
            # Without this, a multi-process launch on a machine with no GPU starts N unconnected copies.
            cpu=device_type() == "cpu",
            # Compiling is --torch_compile's (app/wiring.py): a launcher's dynamo_backend would compile the model in
            # prepare(), and save_pretrained would write its weights under the wrapper's `_orig_mod.` names.
            dynamo_backend="no",
            # Gradient accumulation is the loop's own (app/loop.py): Accelerate's backward would divide every loss by
            # the launcher's --gradient_accumulation_steps (ACCELERATE_GRADIENT_ACCUMULATION_STEPS) on top of it.
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=1),
            **options,
        )
    except (ImportError, ValueError) as e:  # what the launch config asks for cannot be set up here
        raise UsageError(f"Accelerate cannot set up this launch: {first_line(e)}; check the launch config") from None
    finally:
        waiting.cancel()
    launched = launched_world_size()
    if launched > 1 and accelerator.num_processes == 1:
        raise UsageError(
            f"{launched} processes were launched but they are not connected (Accelerate sees 1); on CPU, launch with "
            "--config_file accelerate_configs/cpu_multi.yaml or set ACCELERATE_USE_CPU=1"
        )
    if not accelerator.is_main_process:
        _quiet_libraries()
    return accelerator


def usable_cores() -> int:
    """The cores this process may run on: its affinity (taskset, a Slurm or Kubernetes cpuset), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def more_threads_advice(cores: int) -> str:
    """How one thread becomes `cores`: accelerate launch gives its process one unless told otherwise; without it, a
    one-thread setting comes from the environment."""
    if launched_by_accelerate():
        return f"pass --num_cpu_threads_per_process {cores} to accelerate launch to use all {cores} cores"
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    return f"OMP_NUM_THREADS={threads} in the environment: unset it to use all {cores} cores"


UNLAUNCHED_WAIT_S = 10.0  # how long rank 0 of processes no torchrun started waits for the others before it says so


def unlaunched_world_note() -> str | None:
    """A WORLD_SIZE of several in the environment of a process that no torchrun started (a launch by hand, as srun's,
    or a leftover export in the shell): the process waits for the others to connect, without a word and deaf to
    Ctrl-C, for torch's timeout of 30 minutes. Said by rank 0, once it has waited UNLAUNCHED_WAIT_S."""
    world = launched_world_size()
    if world == 1 or "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("RANK", "0") != "0":
        return None
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return (
        f"note: WORLD_SIZE={world} in the environment, and no launcher started this process: still waiting after "
        f"{UNLAUNCHED_WAIT_S:g} s at {where} for the other {counted(world - 1, 'process')} (a leftover from a "
        "shell? unset RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT to run alone)"
    )


T = TypeVar("T")


def end_accelerator(accelerator: Accelerator) -> None:
    """Accelerate's end_training. With a process group, a full garbage collection first: gloo otherwise sometimes
    aborts at interpreter exit. Only then: a collection costs about 0.2 s in a process that holds torch and
    transformers."""
    if torch.distributed.is_initialized():
        gc.collect()
    accelerator.end_training()


def on_main_process(accelerator: Accelerator, decide: Callable[[], T]) -> T:
    """`decide()` on the main process only (claims, checks of files); every rank returns its result, or raises its
    UsageError, so that all ranks go on, or exit 2, together. Collective when there are several processes."""
    outcome: list = [None]
    if accelerator.is_main_process:
        try:
            outcome = [(decide(), None)]
        except UsageError as e:
            outcome = [(None, str(e))]
        except BaseException:
            if accelerator.num_processes > 1:  # a bug: the others must not wait for an answer that never comes
                broadcast_object_list([(None, "the main process failed; its traceback says why")])
            raise
    if accelerator.num_processes > 1:
        broadcast_object_list(outcome)
    result, error = outcome[0]
    if error is not None:
        raise UsageError(error)
    return result


def _quiet_libraries() -> None:
    """Other ranks would repeat every library warning and progress bar of the main process."""
    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()  # the weight-loading bar, once per rank
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()


# What a collective says when the process at the other end is gone: gloo's TCP transport, its socket closed; NCCL's
# remote error, and its communicator aborted after a peer failed.
_PEER_GONE = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "remote process exited",
    "communicator was aborted",
)


def another_process_ended(error: BaseException) -> bool:
    """Whether a collective failed because another process of the run is gone (killed, crashed): torch's
    DistBackendError, or gloo's RuntimeError, in the words of a peer gone. Any other error (this process's own NCCL
    error, a timeout) is this process's, and keeps its traceback."""
    text = str(error)
    if not any(words in text for words in _PEER_GONE):
        return False
    return isinstance(error, torch.distributed.DistBackendError) or (isinstance(error, RuntimeError) and "gloo" in text)


# The key in the process group's store that the processes left count themselves under, once another one is gone.
_FOUND_GONE = "amp_trainer/found_a_process_gone"
STORE_WAIT_S = 5  # for the store's answer: a store whose machine froze is waited for without end (its own timeout)


def first_to_find_a_process_gone() -> bool:
    """Whether this process is the first of those left to find another one gone: it alone says so, and at once (the
    launcher may stop the others any moment, and the main process may be the one gone). Asked of the process group's
    store, a counter that needs no collective. Where the store went with the process that held it (rank 0, launched
    without torchrun's agent), every process left says it."""
    try:
        store = torch.distributed.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):  # no process group, or a torch without this private accessor
        return True
    answers = []

    def count_this_one() -> None:
        with contextlib.suppress(RuntimeError):  # the store is gone (DistNetworkError): no answer
            answers.append(store.add(_FOUND_GONE, 1))

    asking = threading.Thread(target=count_this_one, daemon=True)  # a frozen store must not hold the process
    with _stderr_hidden():  # a store gone: torch's client prints a C++ stack on stderr before it raises
        asking.start()
        asking.join(STORE_WAIT_S)
    return not answers or answers[0] == 1  # no answer (each process left says it), or the first to count itself


@contextlib.contextmanager
def _stderr_hidden():
    """File descriptor 2 to /dev/null for the block (what C++ code prints there, which Python's streams never see)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:  # from here on fd 2 comes back, whatever interrupts the block (predict.py's SIGTERM raises)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def said_in_one_line_when_another_process_ends(line: Callable[[], str], before_training: bool = False):
    """Another process of the run gone (killed, crashed) fails this one's next collective, with gloo's traceback:
    ProcessLost with `line()` instead, said by the first process left to find it. Any other error is a bug and keeps
    its traceback."""
    try:
        yield
    except Exception as error:
        if not another_process_ended(error):
            raise
        raise ProcessLost(line(), before_training, says=first_to_find_a_process_gone()) from None


class HostCollective:
    """Collectives over values the host already has (a count, a signal), on a CPU (gloo) group: they never wait for
    the GPU's queued work, as a reduce of a device tensor would. No-ops in a single process."""

    def __init__(self, num_processes: int):
        self._group = None
        if num_processes > 1:
            # Collective on every rank, once: a gloo group of its own unless the job's own group is gloo already.
            dist = torch.distributed
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

    def _reduce(self, value: int, op) -> int:
        if self._group is None:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(tensor, op=op, group=self._group)
        return int(tensor.item())  # a CPU tensor: no device sync

    def sum(self, value: int) -> int:
        return self._reduce(value, torch.distributed.ReduceOp.SUM)

    def max(self, value: int) -> int:
        return self._reduce(value, torch.distributed.ReduceOp.MAX)


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({cpu_model()})" if device.type == "cpu" else device.type


def tf32_matmuls() -> bool:
    """Whether CUDA runs fp32 matmuls in TF32. torch 2.9+ reads it from `fp32_precision`: its older `allow_tf32` and
    `get_float32_matmul_precision()` raise once a process has set the new API ("a mix of the legacy and new APIs")."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)  # "none" inherits the default: full fp32
    return matmul.allow_tf32 if precision is None else precision == "tf32"


def tf32_convolutions() -> bool:
    """Whether cuDNN runs fp32 convolutions in TF32 (torch's default), read as `tf32_matmuls` reads its setting."""
    precision = getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", None)
    return torch.backends.cudnn.allow_tf32 if precision is None else precision == "tf32"  # allow_tf32=False: "none"


def backend_name(accelerator: Accelerator) -> str:
    names = {
        DistributedType.NO: "single process",
        DistributedType.MULTI_GPU: "DDP",
        DistributedType.MULTI_CPU: "DDP",
        DistributedType.FSDP: "FSDP2" if getattr(accelerator, "is_fsdp2", False) else "FSDP1",
        DistributedType.DEEPSPEED: "DeepSpeed",
    }
    return names.get(accelerator.distributed_type, str(accelerator.distributed_type))


def requested_backend() -> str | None:
    """What the launch config asked for, as `accelerate launch` tells the script through its environment.

    The one reader of these flags, with Accelerate's own parser: "1", "yes", "true" (and "y", "t", "on") all mean on.
    """
    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        return "DeepSpeed"
    if parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return f"FSDP{os.environ.get('FSDP_VERSION', '1')}"
    return None


def compile_notes(torch_compile: bool, device: torch.device) -> list[str]:
    """What --torch_compile will cost where it does not pay: on a CPU it ran slower than eager in every measurement.
    And a launcher's dynamo_backend, which the app does not apply (connect_accelerator)."""
    notes = []
    if (launched := os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no")).lower() not in ("no", ""):
        how = "--torch_compile compiles the model" if torch_compile else "pass --torch_compile to compile the model"
        notes.append(
            f"note: the launcher's dynamo_backend {launched} is not applied: {how} (so that checkpoints and the saved "
            "model keep the weights' own names)"
        )
    if torch_compile and device.type == "cpu":
        notes.append(
            "note: --torch_compile on a CPU trains slower than eager here: batch lengths change from step to step, so "
            "it compiles again or runs dynamic-shape kernels, and padding to a few fixed lengths adds more work than "
            "it saves (measured: docs/benchmarks.md). On a CPU, leave the flag out"
        )
    return notes


def describe_backend(accelerator: Accelerator) -> list[str]:
    """What runs (backend, process count, device) in one line, then one line per way it differs from the request."""
    device, running = accelerator.device, backend_name(accelerator)
    line = f"backend: {running}, {counted(accelerator.num_processes, 'process')} on {device_name(device)}"
    if accelerator.num_processes > 1 and torch.distributed.is_initialized():
        line += f" ({torch.distributed.get_backend()})"
    if device.type == "cpu":
        # accelerate launch sets OMP_NUM_THREADS=1 unless told otherwise: a silent slowdown worth showing.
        line += f", {counted(torch.get_num_threads(), 'CPU thread')} per process"
        if torch.get_num_threads() == 1 and (cores := usable_cores()) > 1 and accelerator.num_processes == 1:
            line += f" ({more_threads_advice(cores)})"
    lines = [line]
    asked = requested_backend()
    if asked and not running.startswith(asked[:4]):
        why = {"cpu": "Accelerate switches to FSDP and DeepSpeed only on GPUs"}.get(
            device.type, "Accelerate chose otherwise"
        )
        lines.append(
            f"note: {asked} requested, but Accelerate runs {running} on {device.type} ({why}): it runs as {running}"
        )
    elif asked and asked != running:
        lines.append(f"note: {asked} requested, but Accelerate runs {running}")
    multi_cpu_without_mpi = (
        os.environ.get("MASTER_ADDR")
        and "WORLD_SIZE" not in os.environ
        and not any(k in os.environ for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))
    )
    if multi_cpu_without_mpi and accelerator.num_processes == 1:
        lines.append(
            "note: several processes were asked for, but without GPUs or mpirun accelerate launch starts one "
            "(MULTI_CPU): this runs as 1 process; use --config_file accelerate_configs/cpu_multi.yaml for "
            "real processes over gloo"
        )
    if device.type == "cuda":
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if per_node > torch.cuda.device_count():
            lines.append(
                f"note: {per_node} processes on this node but {counted(torch.cuda.device_count(), 'GPU')}: they "
                "share GPUs"
            )
    elif torch.cuda.is_available():
        lines.append(
            f"note: running on the CPU although {counted(torch.cuda.device_count(), 'GPU')} "
            f"{'is' if torch.cuda.device_count() == 1 else 'are'} visible (use_cpu / --cpu)"
        )
    return lines
