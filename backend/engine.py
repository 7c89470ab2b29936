"""LLMEngine: add requests, step, collect outputs. Single-threaded; see engine_thread.py
for the background loop the Triton model uses.

A step reads as the data path: schedule -> run the model -> sample -> update the
scheduler's state -> render each request's delta. The engine owns admission and
wiring; every decision of its own lives in the module named after it. (A little over
300 lines: the constructor wires every part, weights to workers, in one readable place.)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence as Seq, cast

import torch
from tqdm.auto import tqdm

from .batch_invariant import make_batch_invariant, runs_invariant_kernels
from .block_manager import BlockManager
from .checkpoints.hf import checkpoint_tensors
from .compiled_forward import compile_wanted
from .config import EngineConfig
from .cuda_graphs import VERIFY_MAX_SEQS, decode_graphs_wanted
from .device import max_model_len, num_kv_blocks, resolve_device, resolve_dtype
from .distributed import TensorParallelRunner, start_workers
from .errors import ConfigError, InvalidRequestError
from .kv_calibration import CALIBRATION_TEXT, calibrate_kv_scales
from .lora.manager import LoRAManager
from .model_config import ModelConfig
from .model_files import resolve_model_path
from .model_loader import load_model, read_checkpoint
from .model_runner import ModelRunner, StagedTokens
from .models.parallel import SINGLE_RANK
from .multimodal import VLM_ARCHITECTURES, MultiModalPrompt
from .multimodal.image_inputs import ImageInputs
from .output_renderer import OutputRenderer
from .outputs import Completion, EngineStats, RequestOutput
from .quantization import quantize_model
from .sample_group import SampleGroup, SampleGroups, sample_id
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import FinishReason, Sequence, SequenceStatus
from .spec_decode import Speculator, Verification
from .spec_decode.proposers import load_model_proposer
from .structured_output import GrammarCompiler
from .tokenizer import apply_chat_template, encode_prompt

PromptInput = str | Seq[int] | dict[str, Any]
"""A prompt: text, token ids, or vLLM's prompt dict ({"prompt": text, "multi_modal_data": {"image":
file bytes or PIL images}}, {"prompt_token_ids": ids}, or chat {"messages": [...]} whose image parts,
{"type": "image"}, take the images in order)."""

if TYPE_CHECKING:
    from .cpu.backend import CpuBackend
    from .kv_events import KVEventPublisher

logger = logging.getLogger("pagedserve")


@dataclass
class InFlightStep:
    """A step launched on the device whose sampled tokens the engine has not applied yet."""

    batch: ScheduledBatch
    tokens: StagedTokens | None
    needs_host: bool = False
    """A sampling request needs every token on the host before its next step (processors, logprobs)."""
    logits: torch.Tensor | None = None
    """The raw logits, kept where a request wants logprobs."""
    verification: Verification | None = None
    """Speculative decoding: each sampling sequence's drafts (its logits rows and staged tokens are
    1 + that many) and its generator before the rows drew; None: one row each."""


def async_scheduling_wanted(config: EngineConfig, device: torch.device) -> bool:
    """`async_scheduling: auto` overlaps on CUDA with one rank; on CPU the forward runs on the
    engine's own thread, so there is nothing to overlap. Speculative decoding needs each step's
    tokens on the host before the next is scheduled (the drafts follow them): auto is off then."""
    if config.async_scheduling == "auto":
        return device.type == "cuda" and config.tensor_parallel_size == 1 and not config.speculative
    return config.async_scheduling == "on"


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            raise TypeError("pass either an EngineConfig or keyword settings, not both")
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.cpu: CpuBackend | None = None
        """The CPU backend (backend/cpu/) where the device is the CPU: made once, here."""
        if self.device.type == "cpu":
            from .cpu.backend import CpuBackend

            self.cpu = CpuBackend(config)
        self.model_path = resolve_model_path(config.model)
        self.dtype = resolve_dtype(config.dtype, self.device, read_checkpoint(self.model_path, config.load_format).config)

        started = time.perf_counter()
        self.workers = start_workers(config, self.model_path, self.dtype, self.device)
        """Ranks 1..N-1 with tensor_parallel_size N > 1 (this engine is rank 0), else None."""
        compiled = compile_wanted(config, self.device)
        tensor_parallel = self.workers is not None
        cpu = self.cpu
        keep_blocks = cpu.checkpoint_hook(self.dtype, compiled, tensor_parallel) if cpu is not None else None
        parallel = self.workers.parallel if self.workers else SINGLE_RANK
        loaded = load_model(self.model_path, self.dtype, self.device, parallel, config.load_format, keep_blocks)
        invariant = runs_invariant_kernels(config, self.device)
        if config.quantization != "none":
            quantize_model(loaded.model, config.quantization)
        elif invariant:
            make_batch_invariant(loaded.model, self.dtype)
        elif cpu is not None and not compiled:
            cpu.prepare(loaded.model, loaded.config, self.dtype, tensor_parallel)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.images = self._load_images(loaded.config)
        """A vision-language model's processor and image embedder (backend/multimodal/), else None."""
        self.lora = LoRAManager(loaded.model, config, self.dtype, self.device) if config.enable_lora else None
        """The adapters this model serves (enable_lora), else None."""

        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        spec = config.speculative
        draft = load_model_proposer(spec, loaded, self.model_path, self.dtype, self.device, config.attention_backend, cpu,
                                    config.load_format)
        num_blocks = num_kv_blocks(config, loaded.model.local_config, self.device, self.kv_dtype,
                                   draft.block_bytes(config.block_size) if draft is not None else 0)
        self.max_model_len = max_model_len(config, self.model_config, num_blocks)
        graphs = config.max_num_seqs if decode_graphs_wanted(config, self.device) else 0  # decode steps up to this many
        if draft is not None:
            self.max_model_len = draft.fit_context(self.max_model_len, config.max_model_len)
            draft.start(num_blocks, config.block_size, min(graphs, VERIFY_MAX_SEQS), self.max_model_len)
        self.speculator = Speculator(spec, self.max_model_len, draft) if spec is not None else None
        """Speculative decoding's proposer and verifier (speculative_config), else None."""
        self.scheduler = Scheduler(
            BlockManager(num_blocks, config.block_size, config.enable_prefix_caching),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_queue_size=config.max_queue_size,
            policy=config.scheduling_policy,
            max_model_len=self.max_model_len,
            eos_token_ids=self.model_config.eos_token_ids,
            max_loras=config.max_loras if self.lora is not None else 0,
            speculator=self.speculator,
            encoder_budget=self.images.budget(config.max_num_encoder_input_tokens or config.max_num_batched_tokens)
            if self.images is not None else None,
        )
        self.kv_events = self._start_kv_events(config)
        runner_args = (loaded.model, num_blocks, config.block_size, self.kv_dtype, self.device, config.attention_backend,
                       config.max_num_batched_tokens if compiled else 0)
        if self.workers:
            self.runner: ModelRunner = TensorParallelRunner(self.workers, *runner_args)
        else:
            self.runner = ModelRunner(*runner_args, graphs, self.max_model_len, self.lora, batch_invariant=config.deterministic,
                                      images=self.images.embedder if self.images is not None else None,
                                      verify_rows=1 + spec.num_speculative_tokens if spec is not None else 0)
        if config.kv_cache_dtype == "fp8":
            calibrate_kv_scales(self.runner, self.encode(CALIBRATION_TEXT)[: self.max_model_len])
        self.runner.capture_graphs()  # after calibration: the captured kernels take the KV scales as constants
        self.sampler = Sampler(self.model_config.eos_token_ids, config.seed, self.device, batch_invariant=invariant)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self.async_scheduling = async_scheduling_wanted(config, self.device)
        """Schedule step k+1 while step k runs on the device (`step`)."""
        self._in_flight: InFlightStep | None = None
        self.renderers: dict[str, OutputRenderer] = {}
        self.groups = SampleGroups()
        """Requests with n > 1."""
        self.num_recoveries = 0
        self._ids = itertools.count()
        logger.info(
            "engine ready in %.1fs: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d",
            time.perf_counter() - started, self.model_path, self.device, self.dtype,
            num_blocks, config.block_size, self.max_model_len,
        )

    def _load_images(self, model_config: ModelConfig) -> ImageInputs | None:
        if not model_config.vision_language:
            return None
        if self.workers is not None:
            raise ConfigError("tensor_parallel_size", "vision-language models run on one rank; set it to 1")
        config = self.config
        return ImageInputs.load(self.model_path, model_config.vision_language, checkpoint_tensors(self.model_path),
                                self.device, self.dtype, config.max_images_per_prompt, config.max_image_pixels,
                                config.encoder_cache_bytes, config.processor_kwargs)

    @property
    def block_manager(self) -> BlockManager:
        """The scheduler's KV block manager (read it; only the scheduler changes it)."""
        return self.scheduler.block_manager

    # -- requests --------------------------------------------------------------
    def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
               chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a text prompt, or of chat messages in the model's template (with its own
        variables `chat_template_kwargs`, e.g. Qwen3's enable_thinking)."""
        if messages is not None:
            return apply_chat_template(self.tokenizer, messages, template_kwargs=chat_template_kwargs)
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequestError("prompt", "must be a non-empty string")
        return encode_prompt(self.tokenizer, prompt)

    @property
    def grammars(self) -> GrammarCompiler:
        """xgrammar's compiler for this model's vocabulary, made at the first request with a
        structured output (admission threads may race here)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                 list(self.model_config.eos_token_ids))
            return self._grammars

    def check_admission(self, prompt_token_ids: Seq[int], params: SamplingParams, arriving: int = 0) -> None:
        """The one admission check: InvalidRequestError for a request this engine cannot
        serve, QueueFullError when the queue has no room for it after `arriving` requests
        accepted but not yet added (the engine thread's inbox)."""
        self._validate_prompt(prompt_token_ids)
        params.check_vocab(self.model_config.vocab_size)
        if params.lora_name is not None:
            if self.lora is None:
                raise InvalidRequestError("lora_name", f"this model serves no adapters (asked for {params.lora_name!r}); "
                                                       "start it with enable_lora=true and its adapters in lora_modules")
            self.lora.check(params.lora_name)
        if params.structured_outputs is not None:
            self.grammars.prepare(params.structured_outputs)
        config = self.config
        params.check_limits(config.max_stop_strings, config.max_stop_chars, config.max_bad_words)
        self.scheduler.check_room(arriving)

    def _validate_prompt(self, prompt_token_ids: Seq[int]) -> None:
        if len(prompt_token_ids) == 0:
            raise InvalidRequestError("prompt", "is empty; send at least one token")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"has {len(prompt_token_ids)} tokens; the limit is {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len} minus one generated token); shorten it",
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError("input_ids", f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        final_only: bool = False,
    ) -> str:
        """Queue a request (text, token ids, or vLLM's prompt dict with images:
        {"prompt": ..., "multi_modal_data": {"image": ...}}). Raises InvalidRequestError or
        QueueFullError. final_only: only its finished output is wanted (`generate`): no text is
        rendered step by step (OutputRenderer)."""
        ids, mm = self.prompt_inputs(prompt)
        return self.add_processed(ids, mm, params, request_id, arrival_time, final_only)

    def prompt_inputs(self, prompt: PromptInput) -> tuple[list[int], MultiModalPrompt | None]:
        """A prompt's token ids and, where it has images, the images (placeholders expanded)."""
        if isinstance(prompt, str):
            return self.encode(prompt), None
        if not isinstance(prompt, dict):
            return [int(t) for t in prompt], None
        images = (prompt.get("multi_modal_data") or {}).get("image")
        messages, template_kwargs = prompt.get("messages"), prompt.get("chat_template_kwargs")
        if images is None:
            if messages is not None:
                return self.encode(messages=messages, chat_template_kwargs=template_kwargs), None
            text = prompt.get("prompt")
            return (self.encode(text), None) if text is not None else ([int(t) for t in prompt["prompt_token_ids"]], None)
        if self.images is None:
            raise InvalidRequestError("image", "this model takes no images; serve a vision-language model "
                                               f"({', '.join(sorted(VLM_ARCHITECTURES))})")
        return self.images.process(prompt)

    def add_processed(self, ids: Seq[int], mm: MultiModalPrompt | None = None, params: SamplingParams | None = None,
                      request_id: str | None = None, arrival_time: float | None = None, final_only: bool = False) -> str:
        """`add_request` for a prompt `prompt_inputs` made already (ids, and its images or None)."""
        ids = [int(t) for t in ids]
        params = params or self.default_sampling_params()
        self.check_admission(ids, params)  # its caps count the words the request gave, before they are tokenized
        params = self._with_bad_word_ids(params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.groups or request_id in self.renderers:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq_id = request_id if params.n == 1 else sample_id(request_id, 0)
        seq = Sequence(seq_id, ids, params, arrival_time=arrival_time or time.monotonic(), mm=mm)
        self.scheduler.add(seq)
        self._start(seq, final_only)
        if params.n > 1:
            self.groups.add(SampleGroup.fork(request_id, seq, params.n, final_only))
        return request_id

    def _start(self, seq: Sequence, final_only: bool = False) -> None:
        """Give a sample its renderer, with a grammar its matcher, and with a seed its generator
        (seed + sample index, so the n samples of a seeded request differ yet repeat)."""
        if seq.params.seed is not None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(seq.params.seed + seq.sample_index)
        if seq.params.structured_outputs is not None:
            seq.grammar = self.grammars.matcher(seq.params.structured_outputs)
        interval = max(self.config.stream_interval, seq.params.stream_interval or 1)
        self.renderers[seq.request_id] = OutputRenderer(seq, self.tokenizer, interval, final_only)

    def _with_bad_word_ids(self, params: SamplingParams) -> SamplingParams:
        """vLLM's `bad_words` as token sequences, each word alone and after a space
        (how it appears mid-text)."""
        if not params.bad_words:
            return params
        sequences = list(params.bad_words_ids)
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in sequences:
                    sequences.append(ids)
        return dataclasses.replace(params, bad_words=[], bad_words_ids=sequences)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request (every sample of it); its KV blocks are free when this returns."""
        group = self.groups.pop(request_id)
        if group is None:
            return self._abort_sample(request_id)
        group.forks_waiting.clear()
        outputs = {seq.sample_index: self._abort_sample(seq.request_id) for seq in group.samples if not seq.is_finished}
        for seq in group.samples:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, seq.finish_reason or FinishReason.ABORT
        return group.merge({i: o for i, o in outputs.items() if o is not None})

    def _abort_sample(self, seq_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(seq_id)
        renderer = self.renderers.pop(seq_id, None)
        if seq is None or renderer is None:
            return None
        return renderer.collect(finished=True)

    def recover_from_failure(self) -> None:
        """A clean state after a step that raised: every request dropped (blocks freed)
        and the prefix cache forgotten, since the failed step may have left any block
        half written."""
        for request_id in list(self.scheduler.requests):
            self.scheduler.abort(request_id)
        self.renderers.clear()
        self.groups.clear()
        self._in_flight = None
        self.scheduler.block_manager.reset_prefix_cache()
        self.num_recoveries += 1
        self.runner.recover()

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank, which may step on)."""
        self.runner.close()

    def _start_kv_events(self, config: EngineConfig) -> KVEventPublisher | None:
        """The prefix cache's events for routers (kv_events_config): recorded by the block manager,
        sent once a step. The first batch clears what a router knew of this worker (a restart)."""
        if config.kv_events is None:
            return None
        from .kv_events import KVEventPublisher, KVEventRecorder

        recorder = self.scheduler.block_manager.events = KVEventRecorder(config.block_size)
        publisher = KVEventPublisher(config.kv_events, recorder)
        recorder.cleared()
        publisher.flush()
        logger.info("publishing KV-cache events on %s", publisher.endpoint)
        return publisher

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or a launched step whose results are not applied yet."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- stepping --------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, update, and return each request's new output.

        With async scheduling the step launched here is finished by the next call: this
        call schedules and launches step k, then applies step k-1's tokens (the device
        runs step k meanwhile), so the outputs returned are the step before's. Requests
        whose sampling needs every earlier token on the host (penalties, bad words,
        min_tokens, logprobs) make the engine finish a step before scheduling the next."""
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and self._in_flight.needs_host:
            outputs += self._finish(self._in_flight)
            self._in_flight = None
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if self.speculator is not None:
            self.speculator.complete(batch)  # a draft model's drafts (its time counts in the step's)
        launched = self._launch(batch) if batch.seqs else None
        if self._in_flight is not None:
            outputs += self._finish(self._in_flight)
        self._in_flight = launched if self.async_scheduling else None
        if launched is not None and not self.async_scheduling:
            outputs += self._finish(launched)
            if self.speculator is not None and batch.decode_only:  # what a row costs, for the draft lengths
                self.speculator.observe_step(batch.num_tokens, time.perf_counter() - started)
        if self.groups:
            outputs = self._merge_samples(outputs)
        if self.kv_events is not None:
            self.kv_events.flush()
        return outputs

    def _launch(self, batch: ScheduledBatch) -> InFlightStep:
        """Run the step's forward and sampling on the device; nothing waits for them."""
        logits, sampling_seqs = self.runner.execute(batch)
        if self.speculator is not None:  # an EAGLE-3 head's input: the target's hidden states of the step
            self.speculator.observe_target(batch, getattr(self.runner.model, "aux_hidden", None))
        assert len(sampling_seqs) == len(batch.sampling_seqs), "the runner and the scheduler disagree on who samples"
        batch.sampling_seqs = sampling_seqs  # in the order of the logits' rows, which the tokens follow
        if not sampling_seqs:
            return InFlightStep(batch, None)
        verification = None
        if self.speculator is not None and batch.has_drafts:  # rows of the verifying sequences' drafts too
            by_seq = {id(seq): d for seq, d in zip(batch.seqs, batch.drafts)}
            drafts = [by_seq[id(seq)] for seq in sampling_seqs]
            verification = self.speculator.verify(logits, sampling_seqs, drafts, self.sampler)
            tokens = verification.tokens
            self.runner.remember(sampling_seqs, verification.firsts)
        else:
            tokens = self.sampler.sample(logits, sampling_seqs)
            self.runner.remember(sampling_seqs, tokens)
        needs_host = any(seq.params.needs_host_tokens for seq in sampling_seqs) or verification is not None
        wants_logprobs = any(seq.params.logprobs is not None for seq in sampling_seqs)
        return InFlightStep(batch, self.runner.stage_tokens(tokens), needs_host, logits if wants_logprobs else None,
                            verification)

    def _finish(self, step: InFlightStep) -> list[RequestOutput]:
        """Apply a launched step's tokens (waiting for them) and render each request's delta."""
        if step.tokens is None:
            self.scheduler.update_from_output(step.batch, [])
            return []
        tokens = step.tokens.tolist()
        seqs = step.batch.sampling_seqs
        entries: list[int] | list[list[int]] = tokens
        logprobs = None
        if step.verification is not None:  # each sequence's accepted drafts and its own token
            entries, logprobs = self._accepted(step, tokens)
        elif step.logits is not None:
            logprobs = self.sampler.logprobs(step.logits, seqs, tokens)
        # a grammar's request advances by every token it keeps (accepted drafts too), none past its end
        constrained = [(seq, [entry] if isinstance(entry, int) else entry)
                       for seq, entry in zip(seqs, cast("list[int | list[int]]", entries)) if seq.grammar is not None]
        for seq, kept in constrained:
            for index, token in enumerate(kept):
                if seq.grammar.is_terminated():
                    del kept[index:]  # an entry's list: the drafts after the grammar's end are dropped
                    break
                seq.grammar.accept_token(token)
        advanced = self.scheduler.update_from_output(step.batch, entries, logprobs, self._on_token)
        for seq, _ in constrained:
            if seq.grammar.is_terminated() and not seq.is_finished:  # complete (ignore_eos, or EOS not the stop)
                self.scheduler.finish(seq, FinishReason.STOP)
        return [output for seq in advanced if (output := self._render(seq)) is not None]

    def _accepted(self, step: InFlightStep, row_tokens: list[int]) -> tuple[list[list[int]], list | None]:
        """A step with drafts: each sequence's accepted drafts and its own token, and (where asked)
        the logprobs of every one of them from its row's raw logits. A seeded sampled request
        whose drafts were rejected draws again only the rows it kept."""
        verification = step.verification
        assert self.speculator is not None and verification is not None
        seqs, counts = step.batch.sampling_seqs, [1 + len(d) for d in verification.drafts]
        emitted = self.speculator.accept(row_tokens, verification.drafts, seqs)
        for seq, state, count, tokens in zip(seqs, verification.generator_states, counts, emitted):
            if state is not None and len(tokens) < count:
                self.sampler.redraw(seq, state, len(tokens), verification.vocab_size)
        if step.logits is None:
            return emitted, None
        flat = self.sampler.logprobs(step.logits, verification.rows, row_tokens)
        logprobs, offset = [], 0
        for count, tokens in zip(counts, emitted):
            logprobs.append(flat[offset : offset + len(tokens)])
            offset += count
        return emitted, logprobs

    def _on_token(self, seq: Sequence) -> bool:
        """The renderer's account of the token just appended; True when a stop string hit."""
        renderer = self.renderers.get(seq.request_id)
        return renderer is not None and renderer.on_token()

    def _merge_samples(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One output per request (n > 1 samples merged); forks whose prompt is ready start."""
        for group, fork in self.groups.forks_ready():
            self.scheduler.add(fork, check_room=False)
            self._start(fork, group.final_only)
        return self.groups.merge(outputs)

    def _render(self, seq: Sequence) -> RequestOutput | None:
        """The request's delta after its new tokens (their stop strings were looked for as each
        was appended, `_on_token`)."""
        renderer = self.renderers[seq.request_id]
        if seq.is_finished:
            del self.renderers[seq.request_id]
        return renderer.collect(finished=seq.is_finished)

    def stats(self) -> EngineStats:
        scheduler, kv = self.scheduler, self.scheduler.block_manager
        return EngineStats(
            num_running=scheduler.num_running,
            peak_num_running=scheduler.peak_num_running,
            num_waiting=scheduler.num_waiting,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_free=kv.num_free_blocks,
            kv_usage=kv.usage,
            prefix_hit_rate=kv.prefix_hit_rate,
            num_preemptions=scheduler.num_preemptions,
            prompt_tokens=scheduler.prompt_tokens_total,
            generation_tokens=scheduler.generation_tokens_total,
            num_recoveries=self.num_recoveries,
            prefix_query_tokens=kv.prefix_query_tokens,
            prefix_hit_tokens=kv.prefix_hit_tokens,
            block_size=kv.block_size,
            last_step=scheduler.last_step,
            max_lora=scheduler.max_loras,
            running_lora_adapters=scheduler.lora_adapters(scheduler.running) if scheduler.max_loras else (),
            waiting_lora_adapters=scheduler.lora_adapters(scheduler.waiting) if scheduler.max_loras else (),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, Any]:
        if self.speculator is None:
            return {}
        stats = self.speculator.stats
        return {"spec_num_drafts": stats.num_drafts, "spec_num_draft_tokens": stats.num_draft_tokens,
                "spec_num_accepted_tokens": stats.num_accepted_tokens,
                "spec_accepted_per_pos": list(stats.accepted_per_pos),
                "spec_num_backed_off": self.speculator.lengths.num_backed_off,
                "spec_row_cost": self.speculator.lengths.row_cost}

    def prompt_logprobs(self, token_ids: Seq[int]) -> list[float]:
        """Logprob of each token after the first given the ones before it (for perplexity).

        One prefill on blocks the scheduler lends while idle and takes back at once.
        """
        ids = [int(t) for t in token_ids]
        self._validate_prompt(ids)
        with self.scheduler.borrowed_blocks(len(ids)) as block_table:
            logits = self.runner.run_prefill(ids, block_table)[:-1]
        logprobs = logits.log_softmax(dim=-1)
        targets = torch.tensor(ids[1:], device=logprobs.device)
        return logprobs.gather(1, targets[:, None])[:, 0].tolist()

    def default_sampling_params(self) -> SamplingParams:
        """What a request without sampling parameters runs with: vLLM's defaults, less what the
        checkpoint's generation_config.json sets (ModelConfig.generation_defaults), as vLLM's
        `LLM.get_default_sampling_params`."""
        return SamplingParams.from_dict(self.model_config.generation_defaults)

    # -- offline ---------------------------------------------------------------
    def generate(
        self,
        prompts: Iterable[PromptInput],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[Completion]:
        """Run prompts (text, token ids, or prompt dicts with images) to completion in one continuous
        batch; results in prompt order."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or self.default_sampling_params()] * len(prompts)
        completions: dict[str, Completion] = {}
        order = []
        for prompt, p in zip(prompts, params):
            prompt_ids, mm = self.prompt_inputs(prompt)
            request_id = self.add_processed(prompt_ids, mm, p, final_only=True)
            order.append(request_id)
            completions[request_id] = Completion(request_id, prompt_ids)
        with tqdm(total=len(prompts), desc="Generating", unit="req", disable=not use_tqdm, leave=False) as bar:
            while self.has_unfinished_requests():
                for output in self.step():
                    completions[output.request_id].add(output)
                    if output.finished:
                        bar.update(1)
        return [completions[r] for r in order]

    def chat(
        self,
        conversations: Seq[dict] | Seq[Seq[dict]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[Completion]:
        """`generate` over chat messages rendered with the model's chat template, as vLLM's `LLM.chat`:
        one conversation ([{"role": ..., "content": ...}, ...]) or a list of them."""
        many = bool(conversations) and not isinstance(conversations[0], dict)
        chats = cast("list[Seq[dict]]", list(conversations) if many else [conversations])
        return self.generate([self.encode(messages=list(chat)) for chat in chats], params, use_tqdm)
