"""`deterministic` with the Triton kernels (backend/batch_invariant.py): a greedy request's tokens and
logprobs, bit for bit, alone and beside others. On CPU the kernels run in the interpreter
(PAGEDSERVE_FORCE_TRITON=1, the Triton attention named); on a GPU as they are served."""

from __future__ import annotations

import pytest
import torch

from pagedserve.backend import LLMEngine, SamplingParams
from pagedserve.backend.errors import ConfigError
from pagedserve.kernels.dispatch import FORCE_ENV

from .conftest import GPU_SHARE, assert_engine_idle
from .interpreter import use_row_uniform_dot

ON_GPU = torch.cuda.is_available()


@pytest.fixture
def triton_kernels(monkeypatch):
    """The engine's Triton kernels: forced onto CPU tensors where there is no GPU, in the interpreter
    with a dot that sums each row of a tile alike, as a GPU's MMA does (tests/interpreter.py: numpy's
    own matmul does not on every CPU)."""
    if ON_GPU:
        return {}
    monkeypatch.setenv(FORCE_ENV, "1")
    use_row_uniform_dot(monkeypatch)
    return {"attention_backend": "triton"}


@pytest.mark.bit_exact("triton")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_is_the_same_alone_and_beside_others(dtype, small_llama, small_prompts, triton_kernels):
    """The target's prompt runs alone (one chunk), then beside four others of 7 to 164 tokens whose
    prefill chunks share its steps and cut its own prompt elsewhere (a 48-token budget), and its
    decodes run in batches of 1 to 5 rows: the same tokens and the same logprobs to the bit."""
    engine = LLMEngine(model=small_llama, dtype=dtype, deterministic=True, enable_prefix_caching=False,
                       max_num_batched_tokens=48, **triton_kernels, **GPU_SHARE)
    assert engine.runner.compiled is None
    target, others = small_prompts[2], [p for i, p in enumerate(small_prompts) if i != 2]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    alone, = engine.generate([target], params, use_tqdm=False)
    beside = engine.generate([others[0], target, *others[1:]], params, use_tqdm=False)[1]
    assert beside.token_ids == alone.token_ids
    assert [(p.logprob, p.top) for p in beside.logprobs] == [(p.logprob, p.top) for p in alone.logprobs]
    assert_engine_idle(engine)


def test_another_attention_is_refused_by_name(small_llama, triton_kernels):
    """The batch-invariant launch is the Triton attention's: naming the torch one is a ConfigError
    that says which setting to change."""
    with pytest.raises(ConfigError, match="attention_backend.*use 'auto'"):
        LLMEngine(model=small_llama, dtype="bfloat16", deterministic=True, attention_backend="torch", **GPU_SHARE)
