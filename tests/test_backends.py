"""Backends on CPU with gloo: FSDP scaler agreement under real sharding, what actually runs, two nodes, DDP scaling,
and torch.compile."""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from app.telemetry import tags
from tests import forked, tb
from tests.conftest import ACCELERATE, ROOT, assert_trained_alike, clean_env, free_port, launch, run_app

CONFIGS = ROOT / "accelerate_configs"
WORKERS = ROOT / "tests" / "workers"


def accelerate_launch(tmp_path, *args, timeout=300) -> subprocess.CompletedProcess:
    return forked.run([str(ACCELERATE), "launch", *map(str, args)], env=clean_env(tmp_path), timeout=timeout)


@pytest.mark.parametrize("model", ["bert", "llama"])
@pytest.mark.slow
def test_fsdp_ranks_agree_on_overflow_with_the_scaler_the_app_picks(tmp_path, tiny_model_dir, tiny_llama_dir, model):
    result = accelerate_launch(
        tmp_path,
        "--config_file",
        CONFIGS / "cpu_multi.yaml",
        "--main_process_port",
        free_port(),
        WORKERS / "fsdp_worker.py",
        tmp_path,
        tiny_llama_dir if model == "llama" else tiny_model_dir,
        model,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"fsdp-{r}.json").read_text()) for r in (0, 1))
    assert rank0["fsdp1"]["scaler"] == "ShardedGradScaler" and rank0["fsdp2"]["scaler"] == "GradScaler"
    for name in ("fsdp1", "fsdp2"):  # the inf was on rank 1 only; both ranks must skip and halve the scale
        assert rank0[name]["skipped"] and rank1[name]["skipped"], name
        assert rank0[name]["scale"] == rank1[name]["scale"] == 512.0, name
    # The control: the plain scaler under FSDP1 sees only local shards, so the ranks disagree and would diverge.
    assert (rank0["fsdp1_plain"]["skipped"], rank1["fsdp1_plain"]["skipped"]) == (False, True)
    # LoRA on a float16 base: one FSDP2 shard group holds float16 base weights and float32 adapters, the ranks agree on
    # the overflow, and the adapters are gathered and saved as peft's files.
    lora = rank0["fsdp2_lora"]
    assert lora["dtypes"] == ["False:torch.float16", "True:torch.float32"], lora
    assert lora["skipped"] and rank1["fsdp2_lora"]["skipped"] and lora["scale"] == rank1["fsdp2_lora"]["scale"] == 512.0
    with safe_open(tmp_path / "fsdp2_lora" / "adapter_model.safetensors", "pt") as adapters:
        assert any("lora_A" in name for name in adapters.keys())

    if model == "llama":  # every sharded forward is a collective: a rank with fewer prompts left the other waiting
        generated = rank0["generation"]
        assert (
            generated["sharded"] == generated["plain"] == rank1["generation"]["plain"] and len(generated["plain"]) == 3
        )
    loader = AutoModelForCausalLM if model == "llama" else AutoModelForSequenceClassification
    saved = loader.from_pretrained(tmp_path / "fsdp2_model")  # gathered from 2 shards
    assert sum(float(p.detach().sum()) for p in list(saved.parameters())[:3]) == pytest.approx(
        rank0["fsdp2"]["first_param_sum"], abs=1e-6
    )


@pytest.mark.slow
def test_fsdp_config_on_cpu_says_it_runs_ddp_and_trains_with_one_set_of_event_files(tmp_path, quick_args):
    result = launch(
        tmp_path,
        ["--config_file", CONFIGS / "fsdp.yaml", "--main_process_port", free_port()],
        [*quick_args, "--max_steps", "3", "--eval_steps", "0"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend: DDP, 2 processes on cpu" in result.stdout
    assert (
        "note: FSDP2 requested, but Accelerate runs DDP on cpu (Accelerate switches to FSDP and DeepSpeed only "
        "on GPUs): it runs as DDP"
    ) in result.stdout
    runs = list((tmp_path / "runs").iterdir())
    assert [r.name for r in runs] == ["test"] and len(list(runs[0].glob("events.out.tfevents.*"))) == 1
    assert (tmp_path / "out" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_multi_process_cpu_launch_that_starts_one_process_says_so(tmp_path, quick_args):
    result = launch(tmp_path, ["--num_processes", "2"], [*quick_args, "--max_steps", "1", "--eval_steps", "0"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "backend: single process, 1 process on cpu" in result.stdout
    assert (
        "note: several processes were asked for, but without GPUs or mpirun accelerate launch starts one"
        in result.stdout
    )


@pytest.mark.slow
def test_two_nodes_on_one_machine_train_on_different_shards_and_end_identical(tmp_path, tiny_model_dir, review_files):
    """Two launchers, one rank each, joined through multi_node.yaml: the ranks see disjoint shards of every batch,
    get the same gathered evaluation, and end with identical weights."""
    port = free_port()

    def node(rank: int) -> subprocess.CompletedProcess:
        return accelerate_launch(
            tmp_path,
            "--config_file",
            CONFIGS / "multi_node.yaml",
            "--num_machines",
            2,
            "--num_processes",
            2,
            "--machine_rank",
            rank,
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            port,
            "--num_cpu_threads_per_process",
            1,
            WORKERS / "ddp_worker.py",
            tmp_path,
            tiny_model_dir,
            review_files["train"],
            review_files["validation"],
        )

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(node, (0, 1)))
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2], "the two nodes did not form one job"
    assert len(ranks[0]["rows"]) == len(ranks[1]["rows"]) == 4 * 8, "each rank runs 4 steps of 8 examples"
    assert not set(ranks[0]["rows"]) & set(ranks[1]["rows"]), "the ranks saw the same examples"
    assert ranks[0]["eval"] == ranks[1]["eval"], "evaluation is gathered: every rank gets the same figures"
    params = [torch.load(tmp_path / f"params-{r}.pt") for r in (0, 1)]
    for name in params[0]:
        assert torch.equal(params[0][name], params[1][name]), f"{name} differs between the nodes"


@pytest.mark.slow
def test_two_processes_equal_one_process_with_twice_the_batch(
    tmp_path, tiny_model_no_dropout, review_files, one_thread
):
    # One thread on both sides: each rank, and the single process this test compares them with.
    common = [
        "--model_name_or_path",
        tiny_model_no_dropout,
        "--train_file",
        review_files["train"],
        "--validation_file",
        review_files["validation"],
        "--max_length",
        "64",
        "--mixed_precision",
        "no",
        "--max_steps",
        "5",
        "--logging_steps",
        "1",
        "--eval_steps",
        "0",
        "--disable_tqdm",
        "--run_name",
        "r",
    ]
    two = launch(
        tmp_path,
        [
            "--config_file",
            CONFIGS / "cpu_multi.yaml",
            "--main_process_port",
            free_port(),
            "--num_cpu_threads_per_process",
            1,
        ],
        [
            *common,
            "--per_device_train_batch_size",
            "4",
            "--output_dir",
            tmp_path / "two",
            "--logdir",
            tmp_path / "two_runs",
        ],
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "1 CPU thread per process" in two.stdout
    assert (
        run_app(
            [
                *common,
                "--per_device_train_batch_size",
                "8",
                "--output_dir",
                tmp_path / "one",
                "--logdir",
                tmp_path / "one_runs",
            ]
        )
        == 0
    )

    # The same 8 examples per step; only the padding of the two half-batches differs.
    assert_trained_alike(tmp_path, "r", {1, 2, 3, 4, 5}, loss_tolerance=1e-6)


@pytest.mark.slow
def test_torch_compile_matches_eager(tmp_path, tiny_model_no_dropout, review_files, capfd, one_thread):
    common = [
        "--model_name_or_path",
        tiny_model_no_dropout,
        "--train_file",
        review_files["train"],
        "--validation_file",
        review_files["validation"],
        "--max_length",
        "64",
        # Every batch [8, 64] (and the one evaluation batch [48, 64]): one graph each, not one more per new length
        # (a compilation costs 10 to 25 s on 2 cores from a cold cache).
        "--pad_to_multiple_of",
        "64",
        "--mixed_precision",
        "no",
        "--per_device_train_batch_size",
        "8",
        "--max_steps",
        "5",
        "--logging_steps",
        "1",
        "--eval_steps",
        "0",
        "--disable_tqdm",
        "--run_name",
        "r",
    ]
    assert run_app([*common, "--output_dir", tmp_path / "eager", "--logdir", tmp_path / "eager_runs"]) == 0
    torch._dynamo.utils.counters.clear()
    capfd.readouterr()  # the eager run's lines
    assert (
        run_app(
            [*common, "--torch_compile", "--output_dir", tmp_path / "compiled", "--logdir", tmp_path / "compiled_runs"]
        )
        == 0
    )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1, "--torch_compile compiled nothing"
    said = capfd.readouterr().out.splitlines()
    assert said[1].startswith("note: --torch_compile on a CPU trains slower than eager"), said[:3]
    eager = tb.scalars(tmp_path / "eager_runs" / "r")[tags.TRAIN_LOSS]
    compiled = tb.scalars(tmp_path / "compiled_runs" / "r")[tags.TRAIN_LOSS]
    assert eager.keys() == compiled.keys()
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], abs=1e-5), step
    # Saved without the compile wrapper: the same tensor names as the eager model's (no "_orig_mod." prefix).
    assert (
        load_file(tmp_path / "compiled" / "model.safetensors").keys()
        == load_file(tmp_path / "eager" / "model.safetensors").keys()
    )


def test_a_launchers_dynamo_backend_is_not_applied_and_the_saved_weights_keep_their_names(
    tmp_path, quick_args, capfd, monkeypatch
):
    # `accelerate launch --dynamo_backend inductor` (or the wizard's default config) compiled the model in prepare():
    # the saved model's weights were named `_orig_mod.bert...`, and loaded, every one of them was made at random.
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    torch._dynamo.utils.counters.clear()
    assert run_app([*quick_args, "--max_steps", "2", "--eval_steps", "0"]) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0, "compiled"
    assert (
        "note: the launcher's dynamo_backend INDUCTOR is not applied: pass --torch_compile to compile the model (so "
        "that checkpoints and the saved model keep the weights' own names)"
    ) in capfd.readouterr().out.splitlines()
    assert not [key for key in load_file(tmp_path / "out" / "model.safetensors") if "_orig_mod" in key]


def test_one_cpu_thread_gets_advice_for_where_it_came_from(monkeypatch):
    # Plain python with OMP_NUM_THREADS=1 was told to pass a flag to accelerate launch, which it never ran under; under
    # taskset -c 0 (a cpuset of one core) to use the machine's 2 cores, more threads than it may run on.
    from app.host.runtime import connect_accelerator, describe_backend

    accelerator, threads = connect_accelerator(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for launched, cores, advice in (
            (False, 4, " (OMP_NUM_THREADS=1 in the environment: unset it to use all 4 cores)"),
            (True, 4, " (pass --num_cpu_threads_per_process 4 to accelerate launch to use all 4 cores)"),
            (True, 1, ""),  # the one core it may use
        ):
            monkeypatch.setenv("OMP_NUM_THREADS", "1")
            for mark in ("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "ACCELERATE_CONFIG_DS_FIELDS"):
                monkeypatch.delenv(mark, raising=False)
            if launched:
                monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "False")
            monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: set(range(cores)))
            assert describe_backend(accelerator)[0].endswith(f"1 CPU thread per process{advice}"), (launched, cores)
    finally:
        torch.set_num_threads(threads)
