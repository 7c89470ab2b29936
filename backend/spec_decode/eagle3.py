"""EAGLE-3 drafting: one decoder layer fed the target's own hidden states from three of its layers,
through the target's embedding, drafting greedily.

The published format (the EAGLE authors' checkpoints, as vLLM and SGLang load them): a directory
whose config.json names LlamaForCausalLMEagle3 (a Llama config: hidden_size, heads,
intermediate_size, num_hidden_layers 1, vocab_size the target's, draft_vocab_size, rms_norm_eps,
rope; `eagle_config.eagle_aux_hidden_state_layer_ids` where the head reads other layers than
(2, L // 2, L - 3)), and tensors
  fc.weight                      [hidden, 3 x target hidden]: the three hidden states, combined
  midlayer.input_layernorm, midlayer.hidden_norm, midlayer.post_attention_layernorm, norm
  midlayer.self_attn.{q,k,v}_proj [.., 2 x hidden]: the token's normed embedding beside the normed
                                 hidden state; o_proj; midlayer.mlp.{gate,up,down}_proj
  lm_head.weight                 [draft_vocab, hidden]; d2t [draft_vocab]: target id = draft id + d2t
  embed_tokens.weight            where the head has its own (else it reads the target's)
A target layer's hidden state is the residual stream entering it (`LlamaForCausalLM.aux_layers`).

How it runs here. The head's position p pairs the target's hidden states at p with token p + 1
and predicts token p + 2; its K/V live in a one-layer paged cache over the target's block ids
(as a draft model's: one block manager, one KV budget). Every target step leaves the hidden states
of the positions it computed; before the next step runs (`Speculator.complete`), the head
computes its positions for every running request from them (kept up whether or not the request
drafts: the target's hidden states of a position exist only in the step that computed it), rows
of a rejected draft dropped. A drafting request's first draft is the head's prediction at its last
computed position, each further one a forward at the next position from the head's own output
hidden state (no target state exists there yet); those positions are computed again from the
target's states once it has verified them. A prefix-cache hit's positions are taken as computed
(the request that cached the blocks kept the head up over them). The target runs its layers in
Python while the head reads them (the CPU backend's one-call layer loop gives no intermediate
states); on a GPU its decode and verify graphs write those states too (cuda_graphs.py).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionKernels, AttentionMetadata, LayerKVCache, attention
from ..checkpoints.hf import checkpoint_tensors, hf_model_config
from ..errors import ConfigError
from ..model_config import ModelConfig
from ..models.linear import Linear
from ..models.llama import LlamaForCausalLM, RMSNorm, RotaryEmbedding
from ..sequence import Sequence
from .config import FIELD, SpeculativeConfig
from .own_cache import OwnCacheProposer, view

if TYPE_CHECKING:
    from ..scheduler import ScheduledBatch

ARCHITECTURE = "LlamaForCausalLMEagle3"


class Eagle3Head(nn.Module):
    """The head's layer, norm and LM head over a flat batch of rows."""

    draft_to_target: torch.Tensor  # a buffer (register_buffer), declared for the type checker

    def __init__(self, config: ModelConfig, target_hidden: int, draft_vocab: int, max_positions: int,
                 own_embedding: bool):
        super().__init__()
        self.config = self.local_config = config
        hidden, heads, kv_heads, head_dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.intermediate_size = config.intermediate_size
        self.fc = Linear(3 * target_hidden, hidden, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden) if own_embedding else None
        self.input_layernorm = RMSNorm.of(config, hidden)
        self.hidden_norm = RMSNorm.of(config, hidden)
        self.qkv_proj = Linear(2 * hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o_proj = Linear(heads * head_dim, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm.of(config, hidden)
        self.gate_up_proj = Linear(hidden, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, hidden, bias=False)
        self.norm = RMSNorm.of(config, hidden)
        self.lm_head = Linear(hidden, draft_vocab, bias=False)
        self.register_buffer("draft_to_target", torch.arange(draft_vocab), persistent=False)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.scale = head_dim**-0.5

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: LayerKVCache,
                meta: AttentionMetadata, kernels: AttentionKernels) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed output the LM head reads, the output before the norm: a next position's hidden)."""
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        qkv = self.qkv_proj(x)
        qk, v = qkv.split([(self.num_heads + self.num_kv_heads) * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1)
        qk = self.rotary(positions, qk.reshape(-1, self.num_heads + self.num_kv_heads, self.head_dim))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        attn = attention(kernels, q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), kv_cache, meta, self.scale)
        h = hidden + self.o_proj(attn.reshape(hidden.shape[0], -1))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).split(self.intermediate_size, dim=-1)
        h = h + self.down_proj(F.silu(gate) * up)
        return self.norm(h), h

    def draft_ids(self, normed: torch.Tensor) -> list[int]:
        """Each row's greedy token, as the target's id."""
        return self.draft_to_target[self.lm_head(normed).argmax(dim=-1)].tolist()


@dataclass
class _HeadState:
    computed: int
    """The request's leading positions the head has computed from the target's hidden states."""
    preemptions: int
    normed: torch.Tensor | None = None
    """The head's output at its last computed position: the request's next first draft."""
    prenorm: torch.Tensor | None = None


class Eagle3Proposer(OwnCacheProposer):
    """The head, its cache, and each running request's hidden states from the target's last step."""

    keeps_up = True
    """It runs every step, drafting or not: the target's hidden states exist only in their step."""

    def __init__(self, head: Eagle3Head, target: LlamaForCausalLM, aux_layers: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, attention_backend: str, path: str):
        super().__init__(head, head.config, dtype, device, attention_backend, path)
        self.head = head
        self.target = target
        self.aux_layers = aux_layers
        self._states: dict[Sequence, _HeadState] = {}
        self._pending: dict[Sequence, tuple[int, torch.Tensor]] = {}
        """Per request: the first position the target's last step computed, and their hidden states."""

    def start(self, num_blocks: int, block_size: int, graph_max_seqs: int = 0, max_model_len: int = 0) -> None:
        """The head's cache (its forwards run eager), and the target told to keep the layers' states
        the head reads."""
        super().start(num_blocks, block_size)
        self.target.aux_layers = self.aux_layers

    def observe(self, batch: ScheduledBatch, aux: torch.Tensor | None) -> None:
        """The target's step: the hidden states of each sequence's rows (a verify's rejected rows are
        dropped when the head reads them: the target's computed count says how many stand)."""
        if aux is None:
            return
        row = 0
        for seq, start, count in zip(batch.seqs, batch.starts, batch.num_new_tokens):
            self._pending[seq] = (start, aux[row : row + count])
            row += count

    def has_drafted(self, seq: Sequence) -> bool:
        return True  # the head is kept up every step: a shadow costs no catch-up

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch, counts: dict[int, int]) -> dict[int, list[int]]:
        """Keep the head up over every pending request, then drafts for the batch's sequences at
        the indices `counts` names (that many each)."""
        self.forwards = []
        self._catch_up({seq: start for seq, start in zip(batch.seqs, batch.starts)})
        drafts: dict[int, list[int]] = {}
        hidden: dict[int, torch.Tensor] = {}
        for index, seq in enumerate(batch.seqs):
            state = self._states.get(seq)
            if index not in counts or state is None or state.normed is None or state.prenorm is None:
                continue
            drafts[index] = self.head.draft_ids(state.normed[None])
            hidden[index] = state.prenorm
        for position in range(1, max((counts[i] for i in drafts), default=0)):
            going = [index for index in drafts if counts[index] > position]
            if not going:
                break
            started = time.perf_counter()
            views, rows = [], []
            for index in going:
                seq = batch.seqs[index]
                state = self._states[seq]
                tokens = seq.token_ids[1 : state.computed + 1] + drafts[index]
                views.append(view(seq, tokens, len(tokens) - 1))
                rows.append(hidden[index])
            normed, prenorm = self._forward(views, torch.stack(rows))
            for j, (index, token) in enumerate(zip(going, self.head.draft_ids(normed))):
                drafts[index].append(token)
                hidden[index] = prenorm[j]
            self.forwards.append((len(going), time.perf_counter() - started))
        for index in counts:  # no output of the head for it (not met: every step leaves its states): its last token
            drafts.setdefault(index, [batch.seqs[index].token_ids[-1]] * counts[index])
        return drafts

    def _catch_up(self, computed_before: dict[Sequence, int]) -> None:
        """The head's positions from the target's last step, for every request it computed (a
        request's computed count before this step: what the last one kept)."""
        started = time.perf_counter()
        pending, self._pending = self._pending, {}
        views, rows, seqs = [], [], []
        for seq, (start, aux) in pending.items():
            if seq.is_finished:
                self._states.pop(seq, None)
                continue
            state = self._states.get(seq)
            if state is None or state.preemptions != seq.num_preemptions or state.computed > start:
                state = self._states[seq] = _HeadState(start, seq.num_preemptions)  # cached prefix: computed
            if state.computed < start:  # a gap (never here: every step leaves its states): start over there
                state.computed, state.normed, state.prenorm = start, None, None
            end = min(computed_before.get(seq, seq.num_computed_tokens), start + len(aux))  # a verify's kept rows
            if end <= start:
                continue
            views.append(view(seq, seq.token_ids[1 : end + 1], start))
            rows.append(aux[: end - start])
            seqs.append((seq, end))
        if not views:
            return
        combined = self.head.fc(torch.cat(rows).to(self.dtype))
        normed, prenorm = self._forward(views, combined)
        self.forwards.append((len(combined), time.perf_counter() - started))
        last = 0
        for (seq, end), stand_in in zip(seqs, views):
            last += stand_in.num_tokens - stand_in.num_computed_tokens
            state = self._states[seq]
            state.computed, state.normed, state.prenorm = end, normed[last - 1], prenorm[last - 1]
        if len(self._states) > 1024:
            self._states = {seq: s for seq, s in self._states.items() if not seq.is_finished}

    def _forward(self, views: list[Sequence], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over the views' uncomputed positions (their token ids shifted: position p holds
        token p + 1), `hidden` row for row."""
        runner = self.runner
        assert runner is not None
        inputs = runner.to_inputs(runner.plan(self._step(views)))
        embedding = self.head.embed_tokens or self.target.embed
        embeds = embedding(inputs.input_ids)
        return self.head(embeds, hidden.to(embeds.dtype), inputs.positions, runner.kv_caches[0], inputs.meta,
                         runner.attention_kernels)


def aux_layer_ids(config: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """The three target layers the head reads: the checkpoint's, else vLLM's (2, L // 2, L - 3)."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(int(i) for i in ids) if ids else (2, num_layers // 2, num_layers - 3)
    if len(layers) != 3 or not all(0 <= i < num_layers for i in layers):
        raise ConfigError(FIELD, f"the EAGLE-3 head reads target layers {list(layers)}; the target has {num_layers} "
                                 "(set eagle_config.eagle_aux_hidden_state_layer_ids in the head's config.json)")
    return layers


def load_eagle3(spec: SpeculativeConfig, target: LlamaForCausalLM, target_config: ModelConfig, dtype: torch.dtype,
                device: torch.device, attention_backend: str) -> Eagle3Proposer:
    """The EAGLE-3 head of `speculative_config`'s model directory, checked against the target."""
    path = spec.model
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise ConfigError(FIELD, f"model {path!r}: no config.json (an EAGLE-3 head's directory)")
    with open(config_path) as f:
        raw = json.load(f)
    if (raw.get("architectures") or [""])[0] != ARCHITECTURE:
        raise ConfigError(FIELD, f"model {path!r} is not an EAGLE-3 head (config.json names {raw.get('architectures')}, "
                                 f"not {ARCHITECTURE})")
    if target_config.vision_language:
        raise ConfigError(FIELD, "method 'eagle3' is for text models here (use method 'ngram')")
    if target_config.architecture not in ("llama", "qwen2", "qwen3", "mistral") or target_config.num_experts:
        raise ConfigError(FIELD, f"EAGLE-3 heads are read here for Llama-family dense targets, not {target_config.architecture}")
    vocab = raw.get("vocab_size")
    if vocab != target_config.vocab_size:
        raise ConfigError(FIELD, f"the head {path} has vocab_size {vocab}; the target has {target_config.vocab_size}: a "
                                 "head must be trained for its target")
    head_config = hf_model_config({**raw, "architectures": ["LlamaForCausalLM"]})
    target_hidden = int(raw.get("target_hidden_size") or target_config.hidden_size)
    if target_hidden != target_config.hidden_size:
        raise ConfigError(FIELD, f"the head {path} reads hidden states of {target_hidden}; the target's are "
                                 f"{target_config.hidden_size}")
    tensors = dict(checkpoint_tensors(path))
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)
    head = Eagle3Head(head_config, target_hidden, draft_vocab, target_config.max_position_embeddings,
                      "embed_tokens.weight" in tensors)
    _load_weights(head, tensors, path)
    head.to(device=device, dtype=dtype)
    head.draft_to_target = head.draft_to_target.to(torch.int64)
    aux_layers = aux_layer_ids(raw, target_config.num_layers)
    return Eagle3Proposer(head.eval(), target, aux_layers, dtype, device, attention_backend, path)


def _load_weights(head: Eagle3Head, tensors: dict[str, torch.Tensor], path: str) -> None:
    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ConfigError(FIELD, f"the EAGLE-3 head {path} has no tensor {name!r}")
        return tensors[name]

    layer = "midlayer."
    with torch.no_grad():
        head.fc.weight.copy_(take("fc.weight"))
        head.qkv_proj.weight.copy_(torch.cat([take(f"{layer}self_attn.{p}_proj.weight") for p in "qkv"]))
        head.o_proj.weight.copy_(take(f"{layer}self_attn.o_proj.weight"))
        head.gate_up_proj.weight.copy_(torch.cat([take(f"{layer}mlp.gate_proj.weight"), take(f"{layer}mlp.up_proj.weight")]))
        head.down_proj.weight.copy_(take(f"{layer}mlp.down_proj.weight"))
        for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            getattr(head, norm).weight.copy_(take(f"{layer}{norm}.weight"))
        head.norm.weight.copy_(take("norm.weight"))
        head.lm_head.weight.copy_(take("lm_head.weight"))
        if head.embed_tokens is not None:
            head.embed_tokens.weight.copy_(take("embed_tokens.weight"))
        if "d2t" in tensors:
            head.draft_to_target += tensors["d2t"].to(torch.int64)
