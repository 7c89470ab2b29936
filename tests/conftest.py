"""Shared fixtures: the bundled default model, engines built on it, and the
Hugging Face transformers oracle on the same weights."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run through the interpreter on CPU;
    os.environ.setdefault("TRITON_INTERPRET", "1")  # it must be set before triton is imported

from pagedserve.backend import LLMEngine  # noqa: E402
from pagedserve.backend.model_files import default_model_path  # noqa: E402

from . import determinism  # noqa: E402
from .texts import LONG_TEXT  # noqa: E402

CHAT = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    [
        {"role": "user", "content": "My name is Ada. Remember it."},
        {"role": "assistant", "content": "Nice to meet you, Ada! I will remember your name."},
        {"role": "user", "content": "What is my name, and what is 12 times 12?"},
    ],
]
RAW = [
    "The quick brown fox jumps",
    "def fibonacci(n):\n",
    "1, 2, 3, 4, 5,",
    "Translate to French: Good morning, how are you?",
    LONG_TEXT,
]
MAX_TOKENS = [24, 32, 40, 28, 12, 36, 20, 16, 30]

GPU_SHARE = {"num_kv_blocks": 1024} if torch.cuda.is_available() else {}
"""Settings for engines a test builds beside others in one process: on CUDA an engine's KV
cache takes the GPU memory left under gpu_memory_utilization, leaving none for the next."""


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(model_path: str):
    from pagedserve.backend.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


@pytest.fixture(scope="session")
def sentencepiece_tokenizer():
    """A small Llama-2-style tokenizer (SentencePiece "▁" spaces, byte fallback, the
    decoder strips the first leading space), trained in-process on LONG_TEXT."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")  # words start with "▁"
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.train_from_iterator([LONG_TEXT] * 3, trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # byte-fallback pieces are ordinary vocabulary, as in Llama-2
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def engine() -> LLMEngine:
    """The default model in float32 with default settings, shared by tests that leave it clean."""
    return LLMEngine(dtype="float32", **GPU_SHARE)


@pytest.fixture(scope="session")
def prompts(engine: LLMEngine) -> list[list[int]]:
    """Nine varied prompts as token ids: chat-templated and raw, 5 to ~400 tokens."""
    ids = [engine.encode(messages=m) for m in CHAT] + [engine.encode(p) for p in RAW]
    return ids


class HFOracle:
    """Hugging Face transformers on the same GGUF weights: the correctness reference."""

    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM

        directory, name = os.path.split(path)
        self.model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
        self._cache: dict[tuple, list[int]] = {}

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._cache:
            out = self.model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, num_beams=1
            )
            self._cache[key] = out[0, len(prompt_ids) :].tolist()
        return self._cache[key]


@pytest.fixture(scope="session")
def hf_oracle(model_path: str) -> HFOracle:
    return HFOracle(model_path)


def assert_greedy_matches_transformers(engine: LLMEngine, reference, prompts: list[list[int]], max_tokens: int) -> None:
    """The engine's greedy tokens for `prompts`, run as one batch, equal `reference.generate`'s
    one prompt at a time (exactly `max_tokens` each); then the engine is idle."""
    from pagedserve.backend import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    results = engine.generate(prompts, params, use_tqdm=False)
    with torch.inference_mode():
        for prompt, result in zip(prompts, results):
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
            assert result.token_ids == out[0, len(prompt):].tolist()
    assert_engine_idle(engine)


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs `dtype` weights on this CPU (half precision needs avx512_bf16 /
    avx512bw or avx_ne_convert); where it cannot, such weights stay plain."""
    from pagedserve.backend.cpu.linear_methods import pack
    from pagedserve.backend.models.linear import Linear

    return pack(Linear(16, 16).to(dtype))


def assert_engine_idle(engine: LLMEngine) -> None:
    """No leaked KV block and no request left in any queue."""
    kv = engine.block_manager
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_used_blocks} KV blocks leaked"
    assert all(b.ref_count == 0 for b in kv.blocks)
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert not engine.scheduler.requests and not engine.renderers


@pytest.fixture(scope="session")
def small_llama(tmp_path_factory, sentencepiece_tokenizer) -> str:
    """A random 2-layer Llama directory (tests/tensor_parallel_checks.py), for engine
    variants compared token for token (tensor parallel, compiled)."""
    from .tensor_parallel_checks import write_small_llama

    return write_small_llama(tmp_path_factory.mktemp("small-llama"), sentencepiece_tokenizer)


@pytest.fixture(scope="session")
def small_prompts(sentencepiece_tokenizer) -> list[list[int]]:
    """Five prompts of 7 to 164 tokens."""
    words = LONG_TEXT.split()
    texts = ["The quick brown fox", " ".join(words[:20]), " ".join(words[40:130]), "Printers in Venice", " ".join(words[200:230])]
    return [sentencepiece_tokenizer.encode(t) for t in texts]


def pytest_sessionstart(session) -> None:
    """Every C kernel built before the first test (as `make install` does), so no test's time
    includes a compile; tests that build another -march still do."""
    from pagedserve.kernels.cpu.native_build import build_all

    build_all()


def pytest_collection_modifyitems(items) -> None:
    determinism.mark(items)


def pytest_runtest_logreport(report) -> None:
    determinism.record(report)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Which ISA variants of the C kernels the run tested (natively or emulated by SIMDe) and
    which it could not on this CPU (tests/kernels/instruction_sets.py), so that a green run on an
    AVX2 machine says what it did not check; the static kernel report (tests/kernels/static_report.py);
    and on which paths `deterministic` was checked to the bit here (tests/determinism.py)."""
    import sys

    sets = sys.modules.get(f"{__package__}.kernels.instruction_sets") if __package__ else None
    line = sets.summary() if sets is not None else None
    if line:
        terminalreporter.write_sep("-", "C kernel instruction sets")
        terminalreporter.write_line(line)
    report = sys.modules.get(f"{__package__}.kernels.static_report") if __package__ else None
    if report is not None and report.summary():
        terminalreporter.write_sep("-", "static kernel report (compiled for sm_80 / sm_89 / sm_90, no GPU)")
        for text in report.summary():
            terminalreporter.write_line(text)
    line = determinism.summary()
    if line:
        terminalreporter.write_sep("-", "deterministic, checked to the bit")
        terminalreporter.write_line(line)
