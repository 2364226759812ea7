"""Shared fixtures: a tiny BERT built from a config, small review files, and ways to run the app for real.

Nothing is mocked. The tiny model is a real BertModel (2 layers, hidden 32) saved with the embedded MiniLM tokenizer,
so it loads through the same AutoModel/AutoTokenizer path as any user model, with no download.
"""

from __future__ import annotations

import os

# Tests never touch the hub; huggingface_hub reads these once, at import, so they are set before anything imports it.
os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

ROOT = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = ROOT / "app" / "train.py"
ACCELERATE = Path(sys.executable).parent / "accelerate"


def save_tiny_bert(path: Path, dropout: float) -> Path:
    from transformers import AutoTokenizer, BertConfig, BertModel

    from app.model import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(0)
    BertModel(config).save_pretrained(path)  # a base model, like the default: the classification head is new
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"), dropout=0.1)


@pytest.fixture(scope="session")
def tiny_model_no_dropout(tmp_path_factory) -> Path:
    """For comparisons across process counts or compilation, where each draws dropout masks differently."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert-no-dropout"), dropout=0.0)


@pytest.fixture(scope="session")
def review_files(tmp_path_factory) -> dict[str, Path]:
    """96 training and 48 validation reviews as CSV, with the user-data default columns "text" and "label"."""
    from app.config import TrainConfig
    from app.data import load_raw

    raw = load_raw(TrainConfig()).rename_columns({"review": "text", "score": "label"})
    folder = tmp_path_factory.mktemp("reviews")
    files = {"train": folder / "train.csv", "validation": folder / "validation.csv"}
    raw["train"].select(range(96)).to_csv(files["train"], index=False)
    raw["validation"].select(range(48)).to_csv(files["validation"], index=False)
    return files


@pytest.fixture
def quick_args(tmp_path, tiny_model_dir, review_files) -> list[str]:
    """Flags for a fast real run on the tiny model and the small files, writing under tmp_path."""
    return [
        "--model_name_or_path",
        str(tiny_model_dir),
        "--train_file",
        str(review_files["train"]),
        "--validation_file",
        str(review_files["validation"]),
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


def free_port() -> int:
    """A port for a rendezvous or server, so that tests running side by side never collide."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    )
    env.update(extra)
    return env


def launch(
    tmp_path: Path, launcher_flags: list, app_args: list, timeout: int = 240, **env
) -> subprocess.CompletedProcess:
    """`accelerate launch [launcher_flags] app/train.py [app_args]` as a real subprocess."""
    cmd = [str(ACCELERATE), "launch", *map(str, launcher_flags), str(TRAIN_SCRIPT), *map(str, app_args)]
    return subprocess.run(cmd, env=clean_env(tmp_path, **env), capture_output=True, text=True, timeout=timeout)


def python_app(tmp_path: Path, app_args: list, timeout: int = 240, **env) -> subprocess.CompletedProcess:
    """`python app/train.py [app_args]` as a real subprocess (exit codes pass through unchanged)."""
    cmd = [sys.executable, str(TRAIN_SCRIPT), *map(str, app_args)]
    return subprocess.run(cmd, env=clean_env(tmp_path, **env), capture_output=True, text=True, timeout=timeout)
