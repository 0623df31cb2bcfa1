#!/usr/bin/env python3
"""The LLM tests' model: a tiny random-weight Llama and a byte-level BPE
tokenizer trained offline, saved as a Hugging Face folder. Run with the
engine venv's python (it needs transformers and tokenizers); nothing is
downloaded.

Usage: llm_fixture.py OUT_DIR

Writes OUT_DIR/model/ (config.json, model.safetensors, tokenizer files with
a chat template), idempotently: a marker file records a complete build.
The shape: hidden size 128, 2 layers, 4 heads (head size 32: vLLM's CPU
attention refuses 16), vocabulary 512, max_position_embeddings 512.
"""

import json
import os
import shutil
import sys
from pathlib import Path

VERSION = "1"
VOCAB = 512
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus():
    words = (
        "the a of to and in is it you that he was for on are with as I his they be at one have this from "
        "or had by hot word but what some we can out other were all there when up use your how said an each "
        "she which do their time if will way about many then them write would like so these her long make "
        "thing see him two has look more day could go come did number sound no most people my over know "
        "water than call first who may down side been now find any new work part take get place made live "
        "where after back little only round man year came show every good me give our under name very "
        "summarise classify extract translate answer question prompt system user assistant review product"
    ).split()
    lines = []
    for i in range(4000):
        n = 4 + (i * 7) % 13
        lines.append(" ".join(words[(i * 31 + j * 17) % len(words)] for j in range(n)))
    return lines


def main() -> None:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    out = Path(sys.argv[1])
    marker = out / ".complete"
    if marker.exists() and marker.read_text() == VERSION:
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tmp = out / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(tmp)

    torch.manual_seed(46)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp, safe_serialization=True)
    # Greedy decoding of a random model: make the end token likelier so some
    # completions stop before max_tokens (finish_reason "stop").
    with torch.no_grad():
        model.lm_head.weight[fast.eos_token_id] *= 3.0
    model.save_pretrained(tmp, safe_serialization=True)

    dest = out / "model"
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    (out / "fixture.json").write_text(json.dumps({"vocab": VOCAB, "version": VERSION}))
    marker.write_text(VERSION)


if __name__ == "__main__":
    main()
