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


def test_build_kernels_compiles_every_c_kernel_for_this_cpu(capsys):
    """`pagedserve build-kernels` (what `make install` runs): each kernel named ready, every
    C source of the package among them."""
    from pathlib import Path

    import pytest

    from pagedserve.kernels import cpu
    from pagedserve.kernels.cpu.native_build import compiler

    if compiler() is None or os.environ.get("PAGEDSERVE_NATIVE_CPU") == "0":
        pytest.skip("no C compiler here (or the C kernels are turned off)")
    assert main(["build-kernels"]) == 0
    out = capsys.readouterr().out
    sources = sorted(Path(cpu.__file__).parent.glob("*.c"))
    assert f"{len(sources)} of {len(sources)} CPU kernels ready" in out, out
    assert all(f"{source.stem}: ready" in out for source in sources)
