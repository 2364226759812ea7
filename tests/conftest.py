"""Shared fixtures: a tiny BERT built from a config, small review files, and ways to run the app for real.

Nothing is mocked. The tiny model is a real BertModel (2 layers, hidden 32) saved with the embedded MiniLM tokenizer,
so it loads through the same AutoModel/AutoTokenizer path as any user model, with no download.
"""

from __future__ import annotations

import os

# Tests never touch the hub; huggingface_hub reads these once, at import, so they are set before anything imports it.
os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
# The CPU suite hides GPUs, so that a GPU host runs it as a CPU host does; set before torch first looks for CUDA.
# The host's own value is kept in AMP_TRAINER_TEST_HOST_GPUS, for the subprocesses of tests marked `gpu` (gpu_env).
os.environ.setdefault(HOST_GPUS := "AMP_TRAINER_TEST_HOST_GPUS", os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# One OpenMP thread in each worker and each child it starts: with two xdist workers on two cores, two processes of two
# spinning OpenMP threads each fight for the cores (two tiny runs side by side took 19 s with two threads each, 5.9 s
# with one). Runs that need several threads say so through the launcher's --num_cpu_threads_per_process.
os.environ["OMP_NUM_THREADS"] = "1"
# Bytecode is cached, for the children too: where the machine sets PYTHONDONTWRITEBYTECODE (CI does), each of the
# suite's 150 or so processes would otherwise compile the app's modules again (about 0.2 s each).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
import functools
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

import app.amp.policy
from tests import forked

ROOT = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = ROOT / "app" / "train.py"
ACCELERATE = Path(sys.executable).parent / "accelerate"
# The temporary files of the runs a test starts, in one folder per worker, removed as the worker exits: torch's elastic
# agent leaves a torchelastic_* folder behind for each launch. A short path: socket paths under it must stay within
# AF_UNIX's 107 bytes.
CHILDREN_TMPDIR = tempfile.TemporaryDirectory(prefix="suite-")

# The switch that runs the whole suite as on a CPU with (1) or without (0) native bf16, whatever this host has. It is
# read here only: in this process the app's probe is replaced, and a child gets tests/bf16_switch/sitecustomize.py,
# which does the same before the app starts. The product has no such hook. Unset, the probe asks the real CPU.
BF16_SWITCH = "AMP_TRAINER_TEST_BF16"
BF16_SWITCH_DIR = ROOT / "tests" / "bf16_switch"
REAL_BF16_PROBE = app.amp.policy.cpu_has_native_bf16
if os.environ.get(BF16_SWITCH) not in (None, "0", "1"):
    raise pytest.UsageError(f"{BF16_SWITCH} must be 0 or 1, not {os.environ[BF16_SWITCH]!r}")
if os.environ.get(BF16_SWITCH) is not None:
    app.amp.policy.cpu_has_native_bf16 = lambda: os.environ[BF16_SWITCH] == "1"


def force_bf16_probe(monkeypatch, native: bool) -> None:
    """In this process and in the children that clean_env starts: the CPU has native bf16, or it has not."""
    monkeypatch.setenv(BF16_SWITCH, "1" if native else "0")
    monkeypatch.setattr(app.amp.policy, "cpu_has_native_bf16", lambda: native)


def tiny_bert_config(vocab_size: int, hidden_dropout: float, attention_dropout: float, **options):
    """The suite's tiny BERT: 2 layers of width 32."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=hidden_dropout,
        attention_probs_dropout_prob=attention_dropout,
        **options,
    )


def save_tiny_bert(path: Path, dropout: float) -> Path:
    from transformers import AutoTokenizer, BertModel

    from app.inputs.model import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    config = tiny_bert_config(tokenizer.vocab_size, dropout, dropout, max_position_embeddings=128)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(path)  # a base model, like the default: the classification head is new
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), dropout=0.1)


OVERFLOWING = "encoder.layer.1.intermediate.dense"  # in the saved BertModel; "bert." in the classifier built from it


@pytest.fixture(scope="session")
def overflow_model_dir(tmp_path_factory) -> Path:
    """A tiny BERT whose layer-1 intermediate Linear outputs ~1e5: beyond fp16 (65504), harmless in fp32 and bf16."""
    from transformers import BertModel

    path = save_tiny_bert(tmp_path_factory.mktemp("tiny-bert-overflow"), dropout=0.1)
    model = BertModel.from_pretrained(path)
    with torch.no_grad():
        model.get_submodule(OVERFLOWING).weight.mul_(1e6)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_no_dropout(tmp_path_factory) -> Path:
    """For comparisons across process counts or compilation, where each draws dropout masks differently."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert-no-dropout"), dropout=0.0)


@pytest.fixture(scope="session")
def review_files(tmp_path_factory) -> dict[str, Path]:
    """96 training and 48 validation reviews as CSV, with the user-data default columns "text" and "label"."""
    from app.config import TrainConfig
    from app.inputs.data import load_raw

    raw = load_raw(TrainConfig()).rename_columns({"review": "text", "score": "label"})
    folder = tmp_path_factory.mktemp("reviews")
    files = {"train": folder / "train.csv", "validation": folder / "validation.csv"}
    raw["train"].select(range(96)).to_csv(files["train"], index=False)
    raw["validation"].select(range(48)).to_csv(files["validation"], index=False)
    return files


@pytest.fixture(scope="session")
def review_texts(review_files) -> list[str]:
    """The small review files' texts and labels: what the tiny decoders' tokenizers are trained on."""
    import pandas as pd

    frames = [pd.read_csv(path) for path in review_files.values()]
    return [text for frame in frames for text in frame["text"]] + ["great", "other"]


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, review_texts) -> Path:
    from tests.lm_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), review_texts)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory, review_texts) -> Path:
    from tests.lm_models import save_tiny_gpt2

    return save_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"), review_texts)


@pytest.fixture(scope="session")
def conversation_files(tmp_path_factory, review_files) -> dict[str, Path]:
    """The reviews as two-turn conversations, in JSON lines with a "messages" column. Each review is cut to its first
    24 characters, so that a whole conversation fits the tests' --max_length 48 and every assistant turn is learned."""
    import pandas as pd

    folder = tmp_path_factory.mktemp("conversations")
    files = {}
    for split, path in review_files.items():
        rows = pd.read_csv(path).to_dict("records")
        messages = [
            [
                {"role": "user", "content": "Review: " + row["text"][:24]},
                {"role": "assistant", "content": row["label"]},
                {"role": "user", "content": "Sure?"},
                {"role": "assistant", "content": "Yes."},
            ]
            for row in rows
        ]
        files[split] = folder / f"{split}.jsonl"
        pd.DataFrame({"messages": messages}).to_json(files[split], orient="records", lines=True)
    return files


@pytest.fixture(scope="session")
def uneven_responses(tmp_path_factory, review_files) -> dict:
    """Prompt/response files whose responses run from 1 to 12 words, so micro-batches hold unequal label counts."""
    import pandas as pd

    folder = tmp_path_factory.mktemp("uneven")
    files = {}
    for split, path in review_files.items():
        frame = pd.read_csv(path)
        frame["label"] = [" ".join(text.split()[: 1 + i % 12]) for i, text in enumerate(frame["text"])]
        files[split] = folder / f"{split}.csv"
        frame.to_csv(files[split], index=False)
    return files


def data_flags(model_dir, files: dict[str, Path]) -> list:
    """The flags that point a run at a model and at train/validation files: where most tests start."""
    return ["--model_name_or_path", model_dir, "--train_file", files["train"], "--validation_file", files["validation"]]


@pytest.fixture
def quick_args(tmp_path, tiny_model_dir, review_files) -> list[str]:
    """Flags for a fast real run on the tiny model and the small files, writing under tmp_path."""
    return [
        *map(str, data_flags(tiny_model_dir, review_files)),
        "--output_dir",
        str(tmp_path / "out"),
        "--logdir",
        str(tmp_path / "runs"),
        "--run_name",
        "test",
        "--per_device_train_batch_size",
        "8",
        "--max_length",
        "64",
        "--disable_tqdm",
        "--logging_steps",
        "1",
    ]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; each in-process run starts from a clean slate."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


# Each pytest-xdist worker takes ports from its own block, below the kernel's ephemeral range (32768 and up): a port
# the OS hands out for bind(0) can be handed out again to another worker, or to a gloo connection, before the
# rendezvous binds it. Within a worker tests run one at a time, so walking through the block never repeats a port.
_PORT_BLOCK = 500
_worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
_block_start, _offset = 20000 + int(_worker or 0) % 24 * _PORT_BLOCK, random.randrange(_PORT_BLOCK)
_ports = (_block_start + (_offset + i) % _PORT_BLOCK for i in range(_PORT_BLOCK))  # a random start, then round


@pytest.fixture
def one_thread():
    """This process on one intra-op thread, for comparisons with runs that use one: a matmul's result depends on how
    the work is split over threads (about 1e-6 between 1 and 2 threads here), which tolerances must not absorb."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def free_port() -> int:
    """A port for a rendezvous or server, so that tests running side by side never collide."""
    for port in _ports:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # taken by something outside this suite
                continue
            return port
    raise RuntimeError("no free port left in this worker's block")


def folder_state(root: Path, files_only: bool = False) -> list[tuple]:
    """Every entry under `root` (or its files alone) with its size and modification time: equal before and after a
    refused run, nothing was written, replaced or touched."""
    return sorted((p, p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file() or not files_only)


def run_app(args: list) -> int:
    """`app/train.py` in this process: its real main(), returning the exit code."""
    from app.train import main

    return main([str(a) for a in args])


def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a launched run: no user accelerate config (HF_HOME), no hub, no launcher leftovers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env.update(
        HF_HOME=str(tmp_path / "hf_home"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        CUDA_VISIBLE_DEVICES="",
        TMPDIR=CHILDREN_TMPDIR.name,
    )
    env.update(extra)
    if env.get(BF16_SWITCH) is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BF16_SWITCH_DIR), str(ROOT), env.get("PYTHONPATH")]))
    return env


def start_ranks(args: list, tmp_path: Path, stderr=subprocess.PIPE, processes: int = 2) -> list[subprocess.Popen]:
    """Gloo ranks of app/train.py started as srun starts them (the rendezvous in the environment, its store in rank 0),
    so that a test can signal, watch or wait on each rank itself. Text pipes; `stderr=subprocess.STDOUT` merges the
    two."""
    world = str(processes)
    rendezvous = dict(WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return [
        forked.popen(
            [sys.executable, str(TRAIN_SCRIPT), *map(str, args)],
            env=clean_env(tmp_path, RANK=str(r), LOCAL_RANK=str(r), OMP_NUM_THREADS="1", **rendezvous),
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        for r in range(processes)
    ]


def launched_ranks(launcher: subprocess.Popen, processes: int, timeout: float = 60) -> list[psutil.Process]:
    """The processes that `accelerate launch` started, by rank: torchrun starts them in that order (forked ones keep
    the launcher's environment in /proc, so it cannot tell)."""
    deadline = time.monotonic() + timeout
    while len(ranks := psutil.Process(launcher.pid).children(recursive=True)) < processes:
        assert time.monotonic() < deadline, f"{len(ranks)} of {processes} ranks started"
        time.sleep(0.1)
    return sorted(ranks, key=lambda rank: (rank.create_time(), rank.pid))


def assert_trained_alike(tmp_path: Path, run_name: str, steps: set[int], loss_tolerance: float) -> None:
    """A run in 2 processes (its model in `tmp_path/two`, its curves in `tmp_path/two_runs`) and one in 1 process on
    the global batch (`one`, `one_runs`) logged the same training loss at each of `steps`, and saved the same weights
    within 1e-5."""
    from safetensors.torch import load_file

    from app.telemetry import tags
    from tests import tb

    losses_two = tb.scalars(tmp_path / "two_runs" / run_name)[tags.TRAIN_LOSS]
    losses_one = tb.scalars(tmp_path / "one_runs" / run_name)[tags.TRAIN_LOSS]
    assert losses_two.keys() == losses_one.keys() == steps
    for step in losses_one:
        assert losses_two[step] == pytest.approx(losses_one[step], abs=loss_tolerance), step
    two_weights, one_weights = (load_file(tmp_path / name / "model.safetensors") for name in ("two", "one"))
    worst = max(float((two_weights[n] - one_weights[n]).abs().max()) for n in one_weights)
    assert worst < 1e-5, worst


def with_host_gpus(env: dict[str, str]) -> dict[str, str]:
    """The environment with the host's GPUs visible again, as they were before this suite hid them."""
    env = dict(env)
    if env[HOST_GPUS] == "unset":
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = env[HOST_GPUS]
    return env


def gpu_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """clean_env with the host's GPUs visible, for tests marked `gpu`."""
    return with_host_gpus(clean_env(tmp_path, **extra))


@functools.cache
def host_has_cuda() -> bool:
    """Whether the host's GPUs work: asked of a child, since this process hides them."""
    if not list(Path("/dev").glob("nvidia[0-9]*")) and not os.environ.get("CUDA_HOME"):
        return False  # no NVIDIA device node: spare the child
    probe = [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"]
    found = subprocess.run(probe, env=with_host_gpus(os.environ), capture_output=True, text=True, timeout=120)
    return found.stdout.strip() == "True"


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") and not host_has_cuda():
        pytest.skip("needs a CUDA GPU")


class LineWatch:
    """A child's merged stdout/stderr, read on a thread, so that a test can wait for a line with a deadline."""

    def __init__(self, process: subprocess.Popen):
        self.process, self.lines, self._seen = process, [], threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._seen:
                self.lines.append(line)
                self._seen.notify_all()

    def wait_for(self, prefix: str, timeout: float = 180) -> None:
        """Return once a line starting with `prefix` was printed; fail at the deadline or if the child ends first."""
        deadline = time.monotonic() + timeout
        with self._seen:
            while not any(line.startswith(prefix) for line in self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or (self.process.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no line starting {prefix!r} within {timeout} s:\n{self.output()[-2000:]}")
                self._seen.wait(min(left, 1.0))

    def finish(self, timeout: float = 180) -> str:
        """Wait for the child to exit (and its output to be read); return everything it printed."""
        try:
            self.process.wait(timeout=timeout)
        finally:
            self.process.kill()  # a no-op once it has exited; no child outlives its test
        self._reader.join(timeout=30)
        return self.output()

    def output(self) -> str:
        return "".join(self.lines)


def launch(
    tmp_path: Path, launcher_flags: list, app_args: list, timeout: int = 240, **env
) -> subprocess.CompletedProcess:
    """`accelerate launch [launcher_flags] app/train.py [app_args]` as a real subprocess."""
    cmd = [str(ACCELERATE), "launch", *map(str, launcher_flags), str(TRAIN_SCRIPT), *map(str, app_args)]
    return forked.run(cmd, env=clean_env(tmp_path, **env), timeout=timeout)  # the launcher forked, its ranks new


def python_app(tmp_path: Path, app_args: list, timeout: int = 240, **env) -> subprocess.CompletedProcess:
    """`python app/train.py [app_args]` as a real subprocess (exit codes pass through unchanged)."""
    cmd = [sys.executable, str(TRAIN_SCRIPT), *map(str, app_args)]
    return subprocess.run(cmd, env=clean_env(tmp_path, **env), capture_output=True, text=True, timeout=timeout)


def pytest_collection_modifyitems(items):
    """The tests marked slow (several processes each) first, so that the workers finish together rather than one of
    them starting a 30-second test when the other has nothing left (`make test` adds --dist worksteal, which lets an
    idle worker take tests still queued on the other)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # a stable sort: the order within stays


def mounted(tmp_path, size: str):
    """A real filesystem of `size` under tmp_path, unmounted at the end; the test is skipped where it cannot be."""
    mount = tmp_path / f"disk-{size}"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of 20 MB: one checkpoint fits, a second one does not."""
    yield from mounted(tmp_path, "20m")


@pytest.fixture
def tiny_disk(tmp_path):
    """A real filesystem of 16 KB: a run's config and its first TensorBoard points fit, not many more."""
    yield from mounted(tmp_path, "16k")
