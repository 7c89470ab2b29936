"""Speculative decoding with an EAGLE-3 head (spec_decode/eagle3.py): a random head in the published
format (fc, midlayer.*, norm, lm_head, d2t over a smaller draft vocabulary) for a random Llama target:
greedy and seeded sampled tokens equal to speculation off, beside prompt chunks, under preemption
and with n = 2; the head's first draft equal to a plain-torch reference of the published layer over
the target's hidden states; heads that do not fit their target refused."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pagedserve.backend import LLMEngine, SamplingParams
from pagedserve.backend.errors import ConfigError

from .conftest import GPU_SHARE, assert_engine_idle
from .eagle3_checks import write_eagle3_head

pytestmark = pytest.mark.slow


def spec(head: str, k: int = 3) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k, "draft_length": "fixed"}


@pytest.fixture(scope="module")
def head(small_llama, tmp_path_factory) -> str:
    return write_eagle3_head(str(tmp_path_factory.mktemp("eagle3-head")), small_llama)


def greedy(n, **params):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **params)


def test_greedy_and_seeded_tokens_equal_speculation_off_beside_chunks_under_preemption(small_llama, small_prompts, head):
    params = [greedy(n) for n in (30, 12, 40, 25, 18)]
    plain = LLMEngine(model=small_llama, dtype="float32", **GPU_SHARE)
    off = plain.generate(small_prompts, params, use_tqdm=False)
    tight = LLMEngine(model=small_llama, dtype="float32", num_kv_blocks=14, max_num_batched_tokens=48,
                      speculative_config=spec(head))
    on = tight.generate(small_prompts, params, use_tqdm=False)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    stats = tight.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_draft_tokens > 50
    assert_engine_idle(tight)

    roomy = LLMEngine(model=small_llama, dtype="float32", speculative_config=spec(head), max_num_batched_tokens=32,
                      **GPU_SHARE)
    sampled = [SamplingParams(max_tokens=24, temperature=0.9, seed=s, ignore_eos=True, logprobs=1) for s in range(3)]
    two = SamplingParams(max_tokens=20, temperature=0.0, n=2, ignore_eos=True)
    for batch, p in ((small_prompts[:3], sampled), (small_prompts[:1], two)):
        a, b = plain.generate(batch, p, use_tqdm=False), roomy.generate(batch, p, use_tqdm=False)
        flat = lambda outs: [s.token_ids for o in outs for s in (o.samples or [o])]  # noqa: E731
        assert flat(b) == flat(a)
    assert roomy.stats().spec_num_draft_tokens > 0
    assert_engine_idle(roomy)


def reference_first_draft(target, head_dir: str, tokens: list[int]) -> int:
    """The published EAGLE-3 layer in plain torch (dense causal attention, HF's rotary), over the
    target's hidden states: the head's draft after `tokens` (its last position's prediction)."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with open(os.path.join(head_dir, "config.json")) as f:
        cfg = json.load(f)
    w = load_file(os.path.join(head_dir, "model.safetensors"))
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]], -1)[0]
        n = len(tokens) - 1  # position p pairs the hidden states at p with token p + 1
        hidden = aux[:n] @ w["fc.weight"].T
        embeds = model.model.embed_tokens(ids[0, 1:])

        def norm(x, weight):
            return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]))

        L = "midlayer."
        x = torch.cat([norm(embeds, w[f"{L}input_layernorm.weight"]), norm(hidden, w[f"{L}hidden_norm.weight"])], -1)
        heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        dim = cfg["hidden_size"] // heads
        q = (x @ w[f"{L}self_attn.q_proj.weight"].T).view(n, heads, dim).transpose(0, 1)
        k = (x @ w[f"{L}self_attn.k_proj.weight"].T).view(n, kv_heads, dim).transpose(0, 1)
        v = (x @ w[f"{L}self_attn.v_proj.weight"].T).view(n, kv_heads, dim).transpose(0, 1)
        cos, sin = model.model.rotary_emb(v, torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        k, v = k[0].repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
        attn = torch.nn.functional.scaled_dot_product_attention(q[0], k, v, is_causal=True)
        h = hidden + attn.transpose(0, 1).reshape(n, -1) @ w[f"{L}self_attn.o_proj.weight"].T
        m = norm(h, w[f"{L}post_attention_layernorm.weight"])
        h = h + (torch.nn.functional.silu(m @ w[f"{L}mlp.gate_proj.weight"].T) * (m @ w[f"{L}mlp.up_proj.weight"].T)) \
            @ w[f"{L}mlp.down_proj.weight"].T
        logits = norm(h[-1], w["norm.weight"]) @ w["lm_head.weight"].T
        return int(logits.argmax()) + int(w["d2t"][int(logits.argmax())])


def test_the_heads_first_draft_is_the_published_layers_over_the_targets_hidden_states(small_llama, small_prompts, head,
                                                                                       monkeypatch):
    engine = LLMEngine(model=small_llama, dtype="float32", speculative_config=spec(head, k=1), **GPU_SHARE)
    proposer = engine.speculator.draft
    seen = []
    propose = proposer.propose

    def recording(batch, counts):
        drafts = propose(batch, counts)
        seen.extend((list(batch.seqs[i].token_ids), d[0]) for i, d in drafts.items())
        return drafts

    monkeypatch.setattr(proposer, "propose", recording)
    engine.generate([small_prompts[2]], greedy(4), use_tqdm=False)
    assert seen
    for tokens, draft in seen:  # the first after the prompt, then after each verified step
        print(len(tokens), draft, reference_first_draft(small_llama, head, tokens))
        assert draft == reference_first_draft(small_llama, head, tokens)


def test_the_targets_graphs_hand_the_head_the_states_eager_steps_do(small_llama, small_prompts, head):
    """On a GPU the target's decode and verify steps replay graphs that also write the layers'
    states the head reads, handed on in the batch's order. Here over those graphs' static buffers
    (run eagerly): every draft equal to the eager target's, the tokens equal to speculation off."""
    from .test_cuda_graphs import _with_static_verify, drafts_eager_and_over_static_buffers

    params = [greedy(n) for n in (30, 12, 40, 25, 18)]
    off = LLMEngine(model=small_llama, dtype="float32", **GPU_SHARE).generate(small_prompts, params, use_tqdm=False)
    used: list[list[tuple[int, int]]] = []
    eager, static = drafts_eager_and_over_static_buffers(
        lambda: LLMEngine(model=small_llama, dtype="float32", max_num_batched_tokens=48, speculative_config=spec(head),
                          **GPU_SHARE),
        lambda engine: used.append(_with_static_verify(engine, 4)), small_prompts, params, [r.token_ids for r in off])
    assert static == eager and any(eager)
    assert max(size for size, _ in used[0]) > 1


def test_heads_that_do_not_fit_their_target_are_refused(small_llama, tmp_path):
    wrong_vocab = write_eagle3_head(str(tmp_path / "vocab"), small_llama, vocab_size=1000)
    with pytest.raises(ConfigError, match="vocab_size 1000") as error:
        LLMEngine(model=small_llama, dtype="float32", speculative_config=spec(wrong_vocab), **GPU_SHARE)
    assert error.value.field == "speculative_config"
    deep = write_eagle3_head(str(tmp_path / "layers"), small_llama, aux_layers=(2, 5, 9))
    with pytest.raises(ConfigError, match="reads target layers"):
        LLMEngine(model=small_llama, dtype="float32", speculative_config=spec(deep), **GPU_SHARE)
    with pytest.raises(ConfigError, match="not an EAGLE-3 head"):
        LLMEngine(model=small_llama, dtype="float32", speculative_config=spec(small_llama), **GPU_SHARE)


def test_lora_requests_draft_with_the_head_and_equal_speculation_off(small_llama, head, tmp_path):
    """The head reads the target's states as each request's adapter leaves them; the tokens of two
    adapters' requests and a base one equal speculation off's."""
    from .lora_checks import mixed_adapter_batch

    settings, prompts, params = mixed_adapter_batch(small_llama, tmp_path / "adapters")
    settings.update(GPU_SHARE)
    off = LLMEngine(**settings).generate(prompts, params, use_tqdm=False)
    drafted = LLMEngine(**settings, speculative_config=spec(head))
    assert [r.token_ids for r in drafted.generate(prompts, params, use_tqdm=False)] == [r.token_ids for r in off]
    assert drafted.stats().spec_num_draft_tokens > 0
    assert_engine_idle(drafted)
