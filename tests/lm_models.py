"""Tiny decoder models for the causal-LM tests, built from configs, with tokenizers trained here: nothing downloaded.

- a Llama (rotary positions, RMSNorm, grouped-query attention, tied embeddings) whose tokenizer has a ChatML chat
  template, as SmolLM2's has;
- a GPT-2 (learned absolute positions, LayerNorm) whose tokenizer has no chat template and no pad token.
Both tokenizers are byte-level BPEs trained on the test reviews, so every text can be encoded.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Chat templates laid out as well-known models' are, for tokenizers with the special tokens they name.
TEMPLATES = {
    "chatml": CHATML,
    "mistral": (  # Mistral-7B-Instruct-v0.1: the user's text between `[INST] ` and ` [/INST]`, the answer right after
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
    ),
    "llama2": (  # Llama-2-chat's spacing, on a SentencePiece tokenizer
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
        "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
    ),
    "llama3": (  # trimmed contents, headers of special tokens, `<|eot_id|>` ending each turn
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
}


def train_tokenizer(texts: list[str], special: list[str], vocab_size: int = 400, sentencepiece: bool = False):
    """A byte-level BPE (GPT-2's, Llama 3's kind), or with `sentencepiece` one whose words carry `▁` (Llama 2's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>" if sentencepiece else None))
    if sentencepiece:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = sorted({c for text in texts for c in text.replace(" ", "▁")} | {"▁"})
        special = ["<unk>", *special]
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def templated_tokenizer(texts: list[str], template: str):
    """A tokenizer trained on `texts` with the chat template TEMPLATES[template] and the special tokens it names."""
    from transformers import PreTrainedTokenizerFast

    special = {
        "chatml": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "mistral": ["<s>", "</s>"],
        "llama2": ["<s>", "</s>"],
        "llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    }[template]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(texts, special, sentencepiece=template == "llama2"),
        bos_token=None if template == "chatml" else special[0],
        eos_token=special[0] if template == "chatml" else special[1],  # chatml: Qwen2.5's, whose turns end otherwise
        model_max_length=256,
    )
    tokenizer.chat_template = TEMPLATES[template]
    return tokenizer


def save_tiny_llama(path: Path, texts: list[str], dropout: float = 0.0) -> Path:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(texts, special),
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=256,
    )
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(tokenizer, attention_dropout=dropout)).save_pretrained(path)
    return path


def tiny_llama_config(tokenizer=None, tie_word_embeddings: bool = True, **options):
    """The tests' tiny Llama (2 layers of width 32, grouped-query attention) for `tokenizer`'s vocabulary; without a
    tokenizer, 512 tokens and no special ones. `options` override any of it."""
    from transformers import LlamaConfig

    special = (
        {}
        if tokenizer is None
        else {
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
    )
    sizes = dict(
        vocab_size=512 if tokenizer is None else len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaConfig(**{**sizes, **special, "tie_word_embeddings": tie_word_embeddings, **options})


def save_tiny_gpt2(path: Path, texts: list[str], dropout: float = 0.1, positions: int = 256) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(texts, ["<|endoftext|>"]),
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        model_max_length=positions,
    )
    tokenizer.save_pretrained(path)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=positions,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


def save_tiny_gguf(folder: Path, texts: list[str], name: str = "tiny.gguf") -> Path:
    """A tiny Llama written as a GGUF file (fp32 tensors, with the tokenizer's vocabulary), as llama.cpp's converter
    lays one out: what --gguf_file reads. Returns the file's path."""
    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM

    source = save_tiny_llama(folder / "source", texts)
    model, vocabulary = AutoModelForCausalLM.from_pretrained(source), json_vocabulary(source)
    config = model.config
    writer = gguf.GGUFWriter(str(folder / name), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocabulary["tokens"])
    writer.add_token_types(vocabulary["types"])
    writer.add_token_merges(vocabulary["merges"])
    writer.add_eos_token_id(config.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for tensor_name, value in model.state_dict().items():
        if tensor_name != "lm_head.weight":  # tied to the embeddings
            writer.add_tensor(names.get_name(tensor_name, try_suffixes=(".weight",)), value.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder / name


def json_vocabulary(folder: Path) -> dict:
    import json

    saved = json.loads((folder / "tokenizer.json").read_text())
    special = {token["content"] for token in saved["added_tokens"]}
    tokens = [token for token, _ in sorted(saved["model"]["vocab"].items(), key=lambda item: item[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in saved["model"]["merges"]]
    return {"tokens": tokens, "types": [3 if t in special else 1 for t in tokens], "merges": merges}


def save_bigram_llama(path: Path, tokenizer, chain: dict[str, str]) -> Path:
    """A Llama whose greedy next token depends on the last token alone, `chain[last]` (tokens as the tokenizer spells
    them): its layers add nothing to the residual stream and its own (untied) head maps each embedding to the next
    token's row. A model that ends its answers, or runs on, by construction."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer, tie_word_embeddings=False))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embeddings = torch.nn.functional.normalize(torch.randn(len(tokenizer), 32), dim=-1)
        model.model.embed_tokens.weight.copy_(embeddings)
        model.lm_head.weight.zero_()
        for last, following in chain.items():
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(following)] += (
                100 * embeddings[tokenizer.convert_tokens_to_ids(last)]
            )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
