"""On each of 2 ranks: shard a tiny BERT (or a tiny Llama, trained through the causal-LM task's loss) with torch's
FSDP1 or FSDP2 API, put an inf into rank 1's local gradient shard after the reduction, and record whether this rank
skipped the step and its loss scale afterwards.

    accelerate launch --config_file accelerate_configs/cpu_multi.yaml tests/workers/fsdp_worker.py OUT TOKENIZER_DIR \
        [bert|llama]

Scenarios: the scaler the app's precision module picks for FSDP1 and for FSDP2, and the plain GradScaler under
FSDP1 (which should let the ranks disagree). The FSDP2 model is then saved through the app's save_final_model. Last,
LoRA adapters (app/adapters) on a float16 base under FSDP2: float32 adapters and float16 base weights in one shard
group, the app's scaler, and the adapters saved through save_final_model. With the Llama, last: the app's greedy
generation from an FSDP2-sharded model, with fewer prompts on one rank than on the other.
"""

import copy
import gc
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import (  # noqa: E402
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
)

from app.adapters.lora import add_adapters, plan_adapters  # noqa: E402
from app.amp.policy import resolve_precision  # noqa: E402
from app.amp.scaler import OverflowFlag, make_scaler  # noqa: E402
from app.config import TrainConfig  # noqa: E402
from app.host.runtime import build_accelerator  # noqa: E402
from app.storage.final_model import AdaptersBase, save_final_model  # noqa: E402
from app.tasks.causal_lm import token_mean_loss  # noqa: E402
from app.tasks.generation import generate  # noqa: E402
from app.tasks.lm_data import IGNORE, CausalLMCollator  # noqa: E402

out, tokenizer_dir = Path(sys.argv[1]), sys.argv[2]
decoder = sys.argv[3:] == ["llama"]
accelerator = build_accelerator(replace(TrainConfig(), seed=0))
rank = accelerator.process_index
policy, _ = resolve_precision(True, None, "cpu", launcher=None)
policy_fp32, _ = resolve_precision(False, "no", "cpu", launcher=None)
config = BertConfig(
    vocab_size=1000,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    num_labels=2,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
batch = {
    "input_ids": torch.randint(5, 1000, (4, 16), generator=torch.Generator().manual_seed(rank)),
    "labels": torch.tensor([0, 1, 0, 1]),
}
if decoder:  # prompt/response rows of different lengths, the prompt's labels masked, as the task collates them
    ids = [
        torch.randint(5, 1000, (12 + 2 * row,), generator=torch.Generator().manual_seed(rank)).tolist()
        for row in range(4)
    ]
    batch = CausalLMCollator(0, None)([{"input_ids": row, "labels": [IGNORE] * 8 + row[8:]} for row in ids])
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def build(adapters: bool = False) -> torch.nn.Module:
    model = LlamaForCausalLM(config) if decoder else BertForSequenceClassification(config)
    if not adapters:
        return model
    task = "causal_lm" if decoder else "sequence_classification"
    lora = replace(TrainConfig(), use_peft=True, lora_dropout=0.0)
    plan = plan_adapters(lora, model, [], classifier=not decoder)
    return add_adapters(model.to(torch.float16), plan, task)


def loss_of(model: torch.nn.Module) -> torch.Tensor:
    return token_mean_loss(model, batch) if decoder else model(**batch).loss


def shard(model: torch.nn.Module, version: str) -> torch.nn.Module:
    if version == "FSDP1":
        return FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
    inner = getattr(model, "base_model", model).model if hasattr(model, "peft_config") else model
    for layer in inner.model.layers if decoder else inner.bert.encoder.layer:
        fully_shard(layer)
    return fully_shard(model)


results = {}
for name, version, scaler_kind in (
    ("fsdp1", "FSDP1", "app"),
    ("fsdp2", "FSDP2", "app"),
    ("fsdp1_plain", "FSDP1", "plain"),
    ("fsdp2_lora", "FSDP2", "app"),
):
    torch.manual_seed(0)
    model = shard(build(adapters=name.endswith("lora")), version)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scaler = (
        make_scaler(policy, 1024.0, 2000, backend=version)
        if scaler_kind == "app"
        else torch.amp.GradScaler("cpu", init_scale=1024.0)
    )
    with policy.autocast():
        loss = loss_of(model)
    scaler.scale(loss).backward()
    if rank == 1:  # after backward, gradients are reduced and sharded: this inf exists on rank 1 only
        grad = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.numel())
        (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")
    overflow = OverflowFlag(scaler, torch.device("cpu"))
    scaler.unscale_(optimizer)
    overflow.capture(optimizer)
    scaler.step(optimizer)
    scaler.update()
    skipped = overflow.read()
    results[name] = {"scaler": type(scaler).__name__, "skipped": skipped, "scale": scaler.get_scale()}
    if name == "fsdp2_lora":
        results[name]["dtypes"] = sorted({f"{p.requires_grad}:{p.dtype}" for p in model.parameters()})
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        save_final_model(accelerator, model, tokenizer, out / "fsdp2_lora", base=AdaptersBase("tiny"))
    if name == "fsdp2":
        save_final_model(accelerator, model, AutoTokenizer.from_pretrained(tokenizer_dir), out / "fsdp2_model")
        results[name]["first_param_sum"] = sum(
            float((p.full_tensor() if isinstance(p, DTensor) else p).detach().sum())
            for p in list(model.parameters())[:3]
        )

if decoder:  # greedy answers from an FSDP2-sharded model, 3 prompts over 2 ranks: one rank has fewer to generate
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = [tokenizer(text)["input_ids"] for text in ("Fresh coffee", "Stale", "Would buy again, great taste")]
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    answers = {}
    for name, candidate in (("plain", model), ("sharded", shard(copy.deepcopy(model), "FSDP2"))):
        answers[name] = [
            list(answer)
            for answer in generate(accelerator, policy_fp32, candidate, tokenizer, prompts, 6, batch_size=1)
        ]
    results["generation"] = answers

(out / f"fsdp-{rank}.json").write_text(json.dumps(results))
gc.collect()  # before tearing down: gloo otherwise sometimes aborts at interpreter exit
accelerator.end_training()
