"""ModelRunner: owns the model and its KV cache; turns a scheduled batch into one forward.

The flat batch holds every scheduled token: prefill chunks and decodes side by
side. Inputs are built with numpy (no per-token Python work), and logits are
computed only for sequences that sample this step. On CUDA a decode step replays a
captured graph of the whole forward (backend/cuda_graphs.py); other steps run it piecewise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.kernels.dispatch import read_tuned_configs

from .attention import TORCH_KERNELS, AttentionKernels, AttentionMetadata, LayerKVCache, select_attention_kernels
from .compiled_forward import CompiledForward
from .cuda_graphs import VERIFY_MAX_SEQS, DecodeGraphs
from .lora.manager import LoRAManager
from .models.llama import LlamaForCausalLM
from .multimodal.inputs import rotary_positions
from .multimodal.step_embeddings import EmbeddingPatch, ImageEmbedder
from .process_tuning import advise_huge_pages
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch
from .sequence import Sequence

logger = logging.getLogger("pagedserve")


@dataclass
class StepArrays:
    """One step's inputs on the host (numpy), before any device copy."""

    input_ids: np.ndarray  # [tokens] int64
    positions: np.ndarray  # [tokens] int64
    slots: np.ndarray  # [tokens] int64
    block_tables: np.ndarray  # [seqs, max_blocks] int32
    seq_lens: np.ndarray  # [seqs] int64
    query_start: np.ndarray  # [seqs + 1] int64
    logits_indices: np.ndarray  # [sampling seqs] int64
    sampling_seqs: list
    device_rows: np.ndarray  # [k] int64: input rows whose token is still on the device
    device_src: np.ndarray  # [k] int64: its row in the step before's sampled tokens
    token_slots: np.ndarray | None = None  # [tokens] int32: each token's LoRA slot (-1 none); None: no adapter rows
    image_patch: EmbeddingPatch | None = None  # image rows (host) and their embeddings (the encoder's device)
    visible_until: np.ndarray | None = None  # [tokens] int32: bidirectional image spans (AttentionMetadata)


@dataclass
class StagedTokens:
    """A step's sampled token ids on their way to the host."""

    host: torch.Tensor
    ready: torch.cuda.Event | None

    def tolist(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_seqs: list[Sequence]
    lora_slots: torch.Tensor | None = None
    image_patch: EmbeddingPatch | None = None


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = "auto",
        compile_max_tokens: int = 0,
        graph_max_seqs: int = 0,
        max_model_len: int = 0,
        lora: LoRAManager | None = None,
        batch_invariant: bool = False,
        images: ImageEmbedder | None = None,
        verify_rows: int = 0,
    ):
        """compile_max_tokens > 0: run the compiled step (backend/compiled_forward.py),
        warmed up now for steps of up to that many tokens. graph_max_seqs > 0 (CUDA):
        decode steps of up to that many sequences replay whole CUDA graphs
        (backend/cuda_graphs.py), captured by `capture_graphs` for contexts up to max_model_len.
        lora: the model's adapters (enable_lora); a step with adapter rows runs eager, not a graph.
        batch_invariant: the attention's batch-invariant form (`deterministic`).
        images: a vision-language model's image embeddings; a step with image rows runs eager.
        verify_rows > 1 (with graph_max_seqs): speculative decoding's verify steps of up to
        VERIFY_MAX_SEQS sequences replay graphs of their own, that many rows a sequence."""
        self.model = model
        self.lora = lora
        self.images = images
        self.config = model.config
        self.block_size = block_size
        self.device = device
        self.attention_kernels = select_attention_kernels(attention_backend, device, batch_invariant)
        read_tuned_configs(device)  # before any warm-up: the tiles the graphs capture are the committed ones
        self.kv_caches = self.allocate_kv(num_blocks, kv_dtype)
        self.compiled = CompiledForward(model, device) if compile_max_tokens else None
        if self.compiled:
            self.compiled.warm_up(compile_max_tokens)
        self.graphs = DecodeGraphs(self, graph_max_seqs, max_model_len) if graph_max_seqs and device.type == "cuda" else None
        self.verify_graphs = DecodeGraphs(self, min(graph_max_seqs, VERIFY_MAX_SEQS), max_model_len, verify_rows) \
            if self.graphs is not None and verify_rows > 1 else None
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=device)
        self.last_rows: dict[int, int] = {}
        self._token_hosts: list[torch.Tensor] | None = None
        self._token_turn = 0

    def capture_graphs(self) -> None:
        """Capture the decode (and verify) graphs (once the KV scales are final); nothing without them.
        Verify graphs that fail to capture leave verify steps eager, said in the log."""
        if self.graphs is not None:
            self.graphs.capture()
        if self.verify_graphs is not None:
            try:
                self.verify_graphs.capture()
            except Exception as error:  # noqa: BLE001 - the eager verify is correct, only slower
                logger.warning("speculative verify steps run eager: their CUDA graphs did not capture (%s: %s)",
                               type(error).__name__, error)
                self.verify_graphs = None

    def allocate_kv(self, num_blocks: int, dtype: torch.dtype) -> list[LayerKVCache]:
        """Paged K and V per layer for this rank's KV heads (all of them with one rank)."""
        shape = (num_blocks, self.block_size, self.model.local_config.num_kv_heads, self.config.head_dim)

        def cache() -> torch.Tensor:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            advise_huge_pages(tensor)  # CPU: blocks are read from anywhere in it
            return tensor.zero_()

        return [LayerKVCache(cache(), cache()) for _ in range(self.config.num_layers)]

    def plan(self, batch: ScheduledBatch) -> StepArrays:
        """The step's inputs as numpy arrays (no device copy yet). A committed batch (the
        scheduler's) says where each sequence starts and which sample; a token still on
        the device (sampled by the step before, async scheduling) is named by its row there."""
        seqs = batch.seqs
        query_lens = np.asarray(batch.num_new_tokens, dtype=np.int64)
        if batch.starts:
            starts = np.asarray(batch.starts, dtype=np.int64)
            sampling = np.asarray(batch.samples, dtype=bool)
        else:  # a batch built outside the scheduler (run_prefill)
            starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
            sampling = starts + query_lens == np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        seq_lens = starts + query_lens
        query_start = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        num_tokens = int(query_start[-1])

        input_ids = np.zeros(num_tokens, dtype=np.int64)
        max_blocks = max(len(s.block_table) for s in seqs)
        block_tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        device_rows, device_src = [], []
        for i, seq in enumerate(seqs):
            begin, end, start = query_start[i], query_start[i + 1], starts[i]
            if end - begin == 1:
                if start < len(seq.token_ids):
                    input_ids[begin] = seq.token_ids[start]
                else:  # its token is still on the device
                    device_rows.append(begin)
                    device_src.append(self.last_rows[id(seq)])
            elif batch.drafts and batch.drafts[i]:  # a verify: its last token, then its drafts
                input_ids[begin:end] = seq.token_ids[start:] + batch.drafts[i]
            else:
                input_ids[begin:end] = seq.token_ids[start : seq_lens[i]]
            block_tables[i, : len(seq.block_table)] = seq.block_table
        rows = np.repeat(np.arange(len(seqs)), query_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - query_start[rows] + starts[rows]
        slots = block_tables[rows, positions // self.block_size].astype(np.int64) * self.block_size
        slots += positions % self.block_size
        indices, positions = positions, rotary_positions(seqs, positions, query_start)
        seq_slots = self.lora.slots_of(seqs) if self.lora is not None else None
        logits_indices = query_start[1:][sampling] - 1
        if batch.has_drafts:  # a verifying sequence's logits at its last token and at each draft, in order
            counts = sampling * (1 + np.fromiter(map(len, batch.drafts), dtype=np.int64, count=len(seqs)))
            firsts = np.cumsum(counts) - counts
            logits_indices = (np.repeat(query_start[1:] - counts, counts)
                              + np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(firsts, counts))
        patch = self.images.patch(seqs, starts, query_start) if self.images is not None else None
        visible_until = None
        if patch is not None and patch.visible_until is not None:  # an image's tokens see all of it
            visible_until = indices.astype(np.int32)
            visible_until[patch.rows.numpy()] = patch.visible_until
        return StepArrays(input_ids=input_ids, positions=positions, slots=slots, block_tables=block_tables,
                          seq_lens=seq_lens, query_start=query_start, logits_indices=logits_indices,
                          sampling_seqs=[s for s, keep in zip(seqs, sampling) if keep],
                          device_rows=np.asarray(device_rows, dtype=np.int64),
                          device_src=np.asarray(device_src, dtype=np.int64),
                          token_slots=None if seq_slots is None else seq_slots[rows],
                          image_patch=patch, visible_until=visible_until)

    def remember(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """The tokens a step sampled, on the device, for the next step's inputs (async
        scheduling plans that step before they reach the host)."""
        self.last_tokens = tokens
        self.last_rows = {id(seq): row for row, seq in enumerate(seqs)}

    def stage_tokens(self, tokens: torch.Tensor) -> "StagedTokens":
        """Start the step's one device-to-host copy (the sampled ids) without waiting for it."""
        if tokens.device.type == "cpu":
            return StagedTokens(tokens, None)
        turn = self._token_turn = 1 - self._token_turn
        hosts = self._token_hosts
        if hosts is None or len(hosts[0]) < len(tokens):
            size = max(len(tokens), 256)
            hosts = self._token_hosts = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        host = hosts[turn][: len(tokens)]  # two buffers in turn: the step before may still be copying into the other
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return StagedTokens(host, event)

    def fill_device_tokens(self, input_ids: torch.Tensor, rows: np.ndarray, src: np.ndarray) -> None:
        """Write the inputs still on the device into input_ids: row rows[i] takes the token
        the step before sampled in its row src[i]."""
        count = len(rows)
        if count == 0:
            return
        if count == len(input_ids) and count <= len(self.last_tokens) and _is_range(rows) and _is_range(src):
            input_ids[:count].copy_(self.last_tokens[:count])  # every row decodes, in the same order
            return
        rows_t, src_t = self._to_device(rows), self._to_device(src)
        input_ids.index_copy_(0, rows_t, self.last_tokens.index_select(0, src_t))

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        """The step's inputs as device tensors (the piecewise forward's and the tensor-parallel workers')."""
        return self.to_inputs(self.plan(batch))

    def to_inputs(self, arrays: StepArrays) -> ModelInputs:
        to = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to(arrays.slots),
            block_tables=to(arrays.block_tables),
            seq_lens=to(arrays.seq_lens.astype(np.int32)),
            query_start_loc=to(arrays.query_start.astype(np.int32)),
            max_query_len=int((arrays.query_start[1:] - arrays.query_start[:-1]).max()),
            max_seq_len=int(arrays.seq_lens.max()),
            visible_until=None if arrays.visible_until is None else to(arrays.visible_until),
        )
        input_ids = to(arrays.input_ids)
        self.fill_device_tokens(input_ids, arrays.device_rows, arrays.device_src)
        return ModelInputs(
            input_ids=input_ids,
            positions=to(arrays.positions),
            meta=meta,
            logits_indices=to(arrays.logits_indices),
            sampling_seqs=arrays.sampling_seqs,
            lora_slots=None if arrays.token_slots is None else to(arrays.token_slots),
            image_patch=None if arrays.image_patch is None else EmbeddingPatch(
                to(arrays.image_patch.rows.numpy()), arrays.image_patch.values.to(self.device),
                None if arrays.image_patch.rope_positions is None else to(arrays.image_patch.rope_positions.numpy())),
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if self.device.type == "cpu" else tensor.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Run one forward; logits [num_sampling_seqs, vocab] float32 and those sequences, in
        the order of the logits' rows (a decode graph's rows keep each sequence's row)."""
        if self.graphs is not None and not self._adapted(batch) and not _has_image_rows(batch):
            graphs = self.verify_graphs if batch.has_drafts else self.graphs
            if graphs is not None and graphs.takes(batch):
                return graphs.run(batch)
        inputs = self.to_inputs(self.plan(batch))
        return self.run(inputs), inputs.sampling_seqs

    @torch.inference_mode()
    def run(
        self, inputs: ModelInputs, kv_caches: list[LayerKVCache] | None = None, attention: AttentionKernels | None = None
    ) -> torch.Tensor:
        """One forward over prepared inputs: logits of the rows `logits_indices` names,
        [len(logits_indices), vocab] float32 (the one call a tensor-parallel worker makes per step)."""
        input_ids, positions, pieces = inputs.input_ids, inputs.positions, None
        if self.compiled and inputs.image_patch is None:
            pad = self.compiled.rows(len(input_ids)) - len(input_ids)
            input_ids, positions, pieces = F.pad(input_ids, (0, pad)), F.pad(positions, (0, pad)), self.compiled.pieces
        if self.lora is not None:
            self.lora.activate(inputs.lora_slots, inputs.logits_indices)
        if attention is None:  # bidirectional image spans: the torch reference alone takes them
            attention = TORCH_KERNELS if inputs.meta.visible_until is not None else self.attention_kernels
        hidden = self.model(
            input_ids, positions, kv_caches or self.kv_caches, inputs.meta, attention, pieces,
            inputs.logits_indices, inputs.image_patch,
        )
        if len(inputs.logits_indices) == 0:
            return hidden.new_empty((0, self.config.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden)

    def _adapted(self, batch: ScheduledBatch) -> bool:
        """Whether a sequence of the batch runs with a LoRA adapter (its step is not a graph's)."""
        return self.lora is not None and any(seq.params.lora_name is not None for seq in batch.seqs)

    def recover(self) -> None:
        """After a failed step: nothing to rebuild on one rank (tensor parallelism restarts its workers)."""

    def close(self) -> None:
        """Release what the runner holds besides memory: nothing on one rank (tensor parallelism: its workers)."""

    @torch.inference_mode()
    def run_prefill(
        self,
        token_ids: list[int],
        block_table: list[int],
        kv_caches: list[LayerKVCache] | None = None,
        attention: AttentionKernels | None = None,
    ) -> torch.Tensor:
        """One whole-prompt prefill outside the scheduler: logits of every token,
        [num_tokens, vocab] float32. For scoring prompts and fp8 KV calibration, which
        may pass scratch caches and a recording attention."""
        seq = Sequence("prefill", list(token_ids), SamplingParams())
        seq.block_table = list(block_table)
        batch = ScheduledBatch()
        batch.add(seq, len(token_ids))
        inputs = self.prepare(batch)
        inputs.logits_indices = torch.arange(len(token_ids), device=self.device)
        return self.run(inputs, kv_caches, attention)


def _has_image_rows(batch: ScheduledBatch) -> bool:
    """Whether a sequence of the batch computes prompt tokens of a prompt with images (their
    embeddings enter through the eager step; a token after the prompt is text, and the decode graph
    turns it by its multimodal rotary position like any other)."""
    starts = batch.starts or [seq.num_computed_tokens for seq in batch.seqs]
    return any(seq.mm is not None and start < seq.num_prompt_tokens for seq, start in zip(batch.seqs, starts))


def _is_range(values: np.ndarray) -> bool:
    """values == 0, 1, 2, ... (the common case: a decode-only batch in last step's order)."""
    return bool(values[0] == 0 and values[-1] == len(values) - 1 and (len(values) < 3 or np.all(np.diff(values) == 1)))

