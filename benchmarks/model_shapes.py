"""Model directories of real architectures' shapes for `load_format: dummy` (random weights).

A directory holds a Hugging Face config.json and a word-level tokenizer of the model's
vocabulary size (token i is the word "t<i>"), so the engine, the Triton model and
transformers all load it as they load a real model, and every token id decodes. Nothing is
downloaded: the shapes are written here from the models' published configs.
"""

from __future__ import annotations

import json
import random
import os

SHAPES: dict[str, dict] = {
    "llama-3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(  # a draft for the 8B (the same vocabulary)
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(  # the bundled model's shape
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=True,
    ),
    "tiny": dict(  # the CPU dry run of benchmarks/gpu.py
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
}


def write_model_dir(shape: str, directory: str, tokenizer: str = "word") -> str:
    """config.json and a tokenizer for `shape` in `directory` (created); returns it. tokenizer:
    "word" (id i is the word "t<i>") or "byte-level" (a byte-level BPE, as Llama 3's, Qwen's and
    SmolLM's are, trained here on a few sentences: its rendering path is theirs)."""
    config = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    make = {"word": _word_tokenizer, "byte-level": _byte_level_tokenizer}[tokenizer]
    make(config["vocab_size"]).save_pretrained(directory)
    return directory


SENTENCES = ("The quick brown fox jumps over the lazy dog. Serving many requests at once keeps the device busy; "
             "caching the prefix of a prompt saves its prefill. Café, naïve, 日本語, emoji 🎉 and numbers 12345.")


def _byte_level_tokenizer(vocab_size: int):
    """A byte-level BPE of `vocab_size` ids (the 256 bytes, merges, bos/eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    words = random.Random(0)
    filler = " ".join("".join(words.choice("etaoinshrdlucmfwyp") for _ in range(words.randint(2, 9))) for _ in range(4000))
    tokenizer.train_from_iterator([SENTENCES] * 50 + [filler], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def _word_tokenizer(vocab_size: int):
    """A fast tokenizer whose id i is the word "t<i>": every id decodes, text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="t0", eos_token="t1", unk_token="t2")
