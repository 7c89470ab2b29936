"""Model directories of real architectures' shapes for `load_format: dummy` (random weights).

A directory holds a Hugging Face config.json and a word-level tokenizer of the model's
vocabulary size (token i is the word "t<i>"), so the engine, the Triton model and
transformers all load it as they load a real model, and every token id decodes. Nothing is
downloaded: the shapes are written here from the models' published configs.
"""

from __future__ import annotations

import json
import os

SHAPES: dict[str, dict] = {
    "llama-3-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
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


def write_model_dir(shape: str, directory: str) -> str:
    """config.json and a tokenizer for `shape` in `directory` (created); returns it."""
    config = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    _word_tokenizer(config["vocab_size"]).save_pretrained(directory)
    return directory


def _word_tokenizer(vocab_size: int):
    """A fast tokenizer whose id i is the word "t<i>": every id decodes, text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t2"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="t0", eos_token="t1", unk_token="t2")
