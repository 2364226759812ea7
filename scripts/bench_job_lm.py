"""Benchmark the embedded causal-LM job, each process timed from start to end: this app against HF Trainer.

    python scripts/bench.py --job --task causal_lm                          # 480 reviews, about 15 min on 2 cores
    python scripts/bench.py --job --task causal_lm --max_train_samples 160  # a shorter job
    python scripts/bench.py --job --task causal_lm --tiny                   # checks that it runs, says nothing of speed
    python scripts/bench.py --job --task causal_lm --use_peft               # LoRA: against HF + peft and trl (if there)

One after the other, each in its own subprocess:
  app          `make train-lm`'s command (configs/smollm2.yaml), without the evaluation before training
  app_random   the same with --train_sampling_strategy random: the batch order of `hf`, so that the eval losses of
               the two trainers compare like with like (different orders alone move this short job's eval loss by
               several percent)
  hf           HF Trainer on the same prompt/response job with TrainingArguments' defaults (random batches)
  hf_grouped   HF Trainer with train_sampling_strategy="group_by_length"
With --use_peft the job is make train-lm-lora's (configs/smollm2-lora.yaml): the app with its LoRA adapters on a
frozen base, HF Trainer with the same peft model (peft's LoraConfig with the config's r, alpha, dropout and all-linear
targets, the base loaded in the dtype the app's --dtype auto picks), and, where trl is installed (`pip install trl`,
for this benchmark only; the app never imports it), trl's SFTTrainer with `peft_config` on the same base, fed the same
tokens and completion masks, with length grouping, trl's faster setting on a CPU (docs/benchmarks.md).
The job is the same for all: SmolLM2-135M-Instruct (converted from its GGUF file once, before the timing), the
same reviews tokenized the same way (the app's chat-template rendering, prompt labels masked with -100), batch 8,
the config's learning rate with 10% warm-up, weight decay 0.01, clipping at 1.0, one epoch, then an evaluation:
eval loss, and exact match by greedy generation of each validation review's answer (HF has no generation in its
evaluate(), so its run generates after evaluate(), in batches, as a user would). All run in the precision that the
app's `auto` picks here, or in --mixed_precision's. Wall-time ratios below 1 mean the app is faster.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

from bench_job import ACCELERATE, ROOT, _device_name, hf_options, scratch_dir, tensorboard_last, timed

from app.telemetry import tags

CONFIG = ROOT / "configs" / "smollm2.yaml"
LORA_CONFIG = ROOT / "configs" / "smollm2-lora.yaml"
TRAIN_SAMPLES = 480  # fewer than make train-lm's, so that the four runs take about a quarter of an hour on 2 cores


def main(args) -> int:
    from app.amp.policy import resolve_precision
    from app.config import parse_config
    from app.host.device import device_type

    config = LORA_CONFIG if args.use_peft else CONFIG
    workdir = scratch_dir("bench-lm-job-")
    model, model_flags = None, []
    if args.tiny:
        from tests.lm_models import save_tiny_llama

        model = str(save_tiny_llama(workdir / "tiny", ["great other review"] * 50))
        model_flags = ["--model_name_or_path", model]
    cfg = parse_config(["--config", str(config), *model_flags])
    train_samples = args.max_train_samples or (32 if args.tiny else TRAIN_SAMPLES)
    eval_samples = 16 if args.tiny else cfg.max_eval_samples
    policy, _ = resolve_precision(False, args.mixed_precision, device_type(), launcher=None)
    samples = ["--max_train_samples", str(train_samples), "--max_eval_samples", str(eval_samples)]
    if not args.tiny:  # convert the GGUF file before any timing: every run then loads the same cached folder
        model = str(_converted_model())
    app_cmd = [
        *(str(ACCELERATE), "launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no"),
        *("--dynamo_backend", "no", "--num_cpu_threads_per_process", str(os.cpu_count() or 1)),
        *(
            str(ROOT / "app" / "train.py"),
            "--config",
            str(config),
            "--mixed_precision",
            args.mixed_precision,
            "--disable_tqdm",
        ),
        *("--eval_on_start", "false", "--model_name_or_path", model, *samples),
    ]
    result = {"model": model if args.tiny else "SmolLM2-135M-Instruct", "device": _device_name()}
    result["adapters"] = bool(args.use_peft)
    for name, extra in (("app", []), ("app_random", ["--train_sampling_strategy", "random"])):
        run = [*app_cmd, "--output_dir", str(workdir / name), "--logdir", str(workdir / "runs"), "--run_name", name]
        result[f"{name}_wall_s"] = round(timed([*run, *extra]), 1)
        result[f"{name}_eval_loss"] = tensorboard_last(workdir / "runs" / name, tags.EVAL_LOSS)
        result[f"{name}_exact_match"] = tensorboard_last(workdir / "runs" / name, tags.EVAL_EXACT_MATCH)
    peers = [("hf", "hf", "random"), ("hf_grouped", "hf", "group_by_length")]
    if args.use_peft and importlib.util.find_spec("trl"):
        peers.append(("trl_grouped", "trl", "group_by_length"))
    elif args.use_peft:
        print("trl is not installed: its SFTTrainer is left out (pip install trl to compare with it)")
    for name, peer, strategy in peers:
        out = workdir / f"{name}.json"
        worker = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--job", "--task", "causal_lm", "--peer", peer]
        worker += ["--hf_worker", str(out), "--precision", policy.mode, "--strategy", strategy, "--model", model]
        worker += ["--use_peft"] if args.use_peft else []
        result[f"{name}_wall_s"] = round(timed([*worker, *samples]), 1)
        figures = json.loads(out.read_text(encoding="utf-8"))
        result[f"{name}_eval_loss"], result[f"{name}_exact_match"] = figures["eval_loss"], figures["exact_match"]
    names = [name for name, _, _ in peers]
    result |= {"precision": policy.mode, "train_samples": train_samples, "eval_samples": eval_samples}
    for name in names:
        result[f"app_vs_{name}"] = round(result["app_wall_s"] / result[f"{name}_wall_s"], 3)
    fastest = min(names, key=lambda name: result[f"{name}_wall_s"])
    result["fastest_peer"], result["app_vs_fastest_peer"] = fastest, result[f"app_vs_{fastest}"]
    # The same batch order (Accelerate's seedable random sampler, the same seed, in both): the trainers' difference.
    result["eval_loss_app_random_vs_hf"] = round(result["app_random_eval_loss"] / result["hf_eval_loss"], 4)

    print(f"job: {result['model']}, {train_samples} training and {eval_samples} validation reviews; {result['device']}")
    print(f"precision for all: {policy.mode} ({policy.describe()}); adapters: {result['adapters']}")
    print(f"  {'':<12}{'wall s':>10}{'eval loss':>11}{'exact':>8}{'app vs':>9}")
    for name in ("app", "app_random", *names):
        ratio = f"{result[f'app_vs_{name}']:.3f}" if name in names else ""
        wall, loss, exact = (result[f"{name}_{key}"] for key in ("wall_s", "eval_loss", "exact_match"))
        print(f"  {name:<12}{wall:>10.1f}{loss:>11.4f}{exact:>8.3f}{ratio:>9}")
    print(f"app against the fastest peer ({fastest}): {result['app_vs_fastest_peer']}")
    print(
        f"same batch order (random): eval loss app {result['app_random_eval_loss']:.4f} vs HF "
        f"{result['hf_eval_loss']:.4f}, ratio {result['eval_loss_app_random_vs_hf']}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


def _converted_model() -> Path:
    from app.inputs import gguf

    folder, file = gguf.embedded_lm()
    target = gguf.converted_folder(folder, file)
    return gguf.convert(folder, file, target, print)


def hf_worker(args) -> int:
    """One HF Trainer (or trl SFTTrainer) run of the job, as a user would write it; eval loss and exact match go to
    `args.hf_worker`."""
    import torch
    from accelerate import PartialState
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    from app.config import parse_config
    from app.inputs.data import load_raw
    from app.tasks.causal_lm import CausalLM

    config = LORA_CONFIG if args.use_peft else CONFIG
    cfg = parse_config(["--config", str(config), "--model_name_or_path", args.model])
    cfg = replace(cfg, max_train_samples=args.max_train_samples, max_eval_samples=args.max_eval_samples)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # A full fine-tune keeps float32 master weights; adapters sit on a base in the dtype the app's --dtype auto picks.
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=half if args.use_peft else torch.float32)
    raw = load_raw(cfg)
    task = CausalLM.from_data(cfg, raw, tokenizer, model.config)  # the app's rendering: the same tokens as the app's
    tokenized = task.tokenize(raw, PartialState())
    lora = None
    if args.use_peft:
        from peft import LoraConfig

        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
    options = hf_options(cfg, args, "bench-hf-lm-")
    # The adapters from the seed alone, as the app draws them (app/adapters/lora.py): the same start for every trainer.
    set_seed(cfg.seed)
    if args.peer == "trl":
        trainer = _trl_trainer(model, tokenizer, tokenized, lora, options)
    else:
        if lora is not None:
            from peft import get_peft_model

            model = get_peft_model(model, lora)
        trainer = Trainer(
            model=model,
            args=TrainingArguments(**options),
            train_dataset=tokenized["train"],
            eval_dataset=tokenized["validation"],
            data_collator=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100),
        )
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"]
    answers = _greedy_answers(trainer.model, tokenizer, task.prompts, task.max_new_tokens(), args.precision)
    exact = sum(a.strip() == r for a, r in zip(answers, task.references)) / max(len(task.references), 1)
    args.hf_worker.write_text(json.dumps({"eval_loss": eval_loss, "exact_match": exact}), encoding="utf-8")
    return 0


def _trl_trainer(model, tokenizer, tokenized, lora, options: dict):
    """trl's SFTTrainer on the app's tokens: each row's ids with a completion mask (1 where the app has a label), so
    trl learns the same tokens; the rows fit max_length already, so trl truncates nothing."""
    from trl import SFTConfig, SFTTrainer

    def with_completion_mask(split):
        masks = [[int(label != -100) for label in labels] for labels in split["labels"]]
        return split.remove_columns("labels").add_column("completion_mask", masks)

    return SFTTrainer(
        model=model,
        args=SFTConfig(**options, max_length=None, completion_only_loss=True),
        train_dataset=with_completion_mask(tokenized["train"]),
        eval_dataset=with_completion_mask(tokenized["validation"]),
        processing_class=tokenizer,
        peft_config=lora,
    )


def _greedy_answers(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, precision: str) -> list[str]:
    """Greedy answers in batches of 16, left padded: the loop a user writes around generate()."""
    import torch

    model.eval()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    answers = []
    for start in range(0, len(prompts), 16):
        chunk = prompts[start : start + 16]
        width = max(map(len, chunk))
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        with torch.no_grad(), torch.autocast(model.device.type, dtype=dtype, enabled=dtype is not None):
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
        answers += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return answers
