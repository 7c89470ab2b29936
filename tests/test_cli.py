"""The `pagedserve` commands that need no server."""

from __future__ import annotations

import os

from transformers import AutoTokenizer

from pagedserve.backend.model_files import default_model_path
from pagedserve.backend.tokenizer import load_tokenizer
from pagedserve.client.cli import main


def test_tokenizer_prints_a_directory_that_tokenizes_like_the_model(capsys):
    assert main(["tokenizer"]) == 0
    directory = capsys.readouterr().out.strip()
    assert os.path.isfile(os.path.join(directory, "tokenizer_config.json"))
    text = "The capital of France is Paris. 東京 🙂"
    assert AutoTokenizer.from_pretrained(directory).encode(text) == load_tokenizer(default_model_path()).encode(text)
