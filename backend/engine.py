"""LLMEngine: add requests, step, collect outputs. Single-threaded; see engine_thread.py
for the background loop the Triton model uses."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence as Seq

import torch
from tqdm.auto import tqdm

from .block_manager import BlockManager
from .config import EngineConfig
from .cpu_tuning import keep_freed_memory_in_heap
from .errors import ConfigError, InvalidRequestError
from .loader import load_model, resolve_model_path
from .model_runner import ModelRunner, kv_block_bytes
from .outputs import Completion, RequestOutput
from .quantization import quantize_model
from .request_stream import RequestStream
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import FinishReason, Sequence
from .tokenizer import apply_chat_template, encode_prompt

logger = logging.getLogger("pagedserve")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Text whose prefill sets the fp8 KV scales: varied prose, code, numbers and chat markup.
KV_CALIBRATION_TEXT = (
    "Photosynthesis converts light energy into chemical energy stored in glucose. In 1969 the Apollo 11 "
    "crew landed on the Moon; Neil Armstrong stepped out first. def mean(xs):\n    return sum(xs) / len(xs)\n"
    "Q: What is 17 times 23? A: 391. The quick brown fox jumps over the lazy dog. Markets rose 2.5% on "
    "Tuesday after the central bank held rates steady. <|im_start|>user\nCan you suggest a recipe for "
    "dinner?<|im_end|>\n<|im_start|>assistant\nSure! A simple pasta with garlic, olive oil and chili takes "
    "fifteen minutes. Bonjour, comment allez-vous ? Ich lerne Deutsch. 日本語も少し話せます。"
)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    peak_num_running: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_usage: float
    prefix_hit_rate: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            raise TypeError("pass either an EngineConfig or keyword settings, not both")
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = _resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        self.dtype = _resolve_dtype(config.dtype, self.device)
        self.model_path = resolve_model_path(config.model)

        started = time.perf_counter()
        loaded = load_model(self.model_path, self.dtype, self.device)
        if config.quantization != "none":
            quantize_model(loaded.model, config.quantization)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        context = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            context = min(context, self.model_config.sliding_window)  # exact without a sliding-window kernel
        if config.max_model_len > context:
            raise ConfigError(
                "max_model_len", f"must be <= the model's context length {context}, got {config.max_model_len}"
            )

        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        num_blocks = self._num_kv_blocks(self.kv_dtype)
        capacity = num_blocks * config.block_size
        self.max_model_len = config.max_model_len or min(context, capacity)
        if self.max_model_len > capacity:
            raise ConfigError(
                "max_model_len",
                f"{self.max_model_len} tokens do not fit the KV cache ({num_blocks} blocks x "
                f"{config.block_size} = {capacity} tokens); raise the KV budget or lower max_model_len",
            )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_queue_size=config.max_queue_size,
            policy=config.scheduling_policy,
        )
        self.runner = ModelRunner(
            loaded.model, num_blocks, config.block_size, self.kv_dtype, self.device, config.attention_backend
        )
        if config.kv_cache_dtype == "fp8":
            self.runner.calibrate_kv_scales(self.encode(KV_CALIBRATION_TEXT)[: self.max_model_len])
        self.sampler = Sampler(self.model_config.eos_token_ids, config.seed, self.device)
        self.streams: dict[str, RequestStream] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._ids = itertools.count()
        logger.info(
            "engine ready in %.1fs: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d",
            time.perf_counter() - started, self.model_path, self.device, self.dtype,
            num_blocks, config.block_size, self.max_model_len,
        )

    def _num_kv_blocks(self, kv_dtype: torch.dtype) -> int:
        config = self.config
        if config.num_kv_blocks:
            return config.num_kv_blocks
        per_block = kv_block_bytes(self.model_config, config.block_size, kv_dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - config.gpu_memory_utilization) * total
        else:
            budget = config.kv_cache_bytes
        num_blocks = int(budget // per_block)
        if num_blocks < 1:
            raise ConfigError("kv_cache_bytes", f"the KV budget holds no block of {per_block} bytes; raise it")
        return num_blocks

    # -- requests --------------------------------------------------------------
    def encode(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        """Token ids of a text prompt, or of chat messages in the model's template."""
        if messages is not None:
            return apply_chat_template(self.tokenizer, messages)
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequestError("prompt", "must be a non-empty string")
        return encode_prompt(self.tokenizer, prompt)

    def validate(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError for a request this engine cannot serve."""
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
        params.check_vocab(vocab)

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Queue a request (text or token ids). Raises InvalidRequestError or QueueFullError."""
        params = params or SamplingParams()
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.validate(ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(request_id, ids, params, arrival_time=arrival_time or time.monotonic())
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(params.seed)
        self.scheduler.add(seq)
        self.streams[request_id] = RequestStream(seq, self.tokenizer)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; its KV blocks are free when this returns."""
        seq = self.scheduler.abort(request_id)
        stream = self.streams.pop(request_id, None)
        if seq is None or stream is None:
            return None
        return stream.collect(finished=True)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping --------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and return each request's new output."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                self.prompt_tokens_total += seq.num_prompt_tokens
        logits, sampling_seqs = self.runner.execute(batch)
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq)
        outputs: list[RequestOutput] = []
        if sampling_seqs:
            sampled = self.sampler(logits, sampling_seqs)
            now = time.monotonic()
            for seq, token, logprob in zip(sampling_seqs, sampled.token_ids, sampled.logprobs):
                output = self._append_token(seq, token, logprob, now)
                if output is not None:
                    outputs.append(output)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: Any, now: float) -> RequestOutput | None:
        seq.append_token(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if seq.first_token_time is None:
            seq.first_token_time = now
        self.generation_tokens_total += 1
        stream = self.streams[seq.request_id]
        reason = self._finish_reason(seq, token, stop_string_hit=stream.on_token())
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self.streams[seq.request_id]
        return stream.collect(finished=reason is not None)

    def _finish_reason(self, seq: Sequence, token: int, stop_string_hit: bool) -> FinishReason | None:
        params = seq.params
        if stop_string_hit:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.min_tokens:
            if (not params.ignore_eos and token in self.model_config.eos_token_ids) or token in params.stop_token_ids:
                return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def stats(self) -> EngineStats:
        kv = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            peak_num_running=self.scheduler.peak_num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_free=kv.num_free_blocks,
            kv_usage=kv.usage,
            prefix_hit_rate=kv.prefix_hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total,
        )

    def prompt_logprobs(self, token_ids: Seq[int]) -> list[float]:
        """Logprob of each token after the first given the ones before it (for perplexity).

        Runs one prefill outside the scheduler, on blocks borrowed from the cache
        (it must be idle) and returned at once.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("prompt_logprobs needs an idle engine")
        ids = [int(t) for t in token_ids]
        self.validate(ids, SamplingParams())
        seq = Sequence("score", ids, SamplingParams())
        if not self.block_manager.allocate(seq, len(ids)):
            raise InvalidRequestError("prompt", "does not fit the KV cache")
        try:
            batch = ScheduledBatch()
            batch.add(seq, len(ids))
            logits = self.runner.all_logits(batch)[:-1]
            logprobs = logits.log_softmax(dim=-1)
            targets = torch.tensor(ids[1:], device=logprobs.device)
            return logprobs.gather(1, targets[:, None])[:, 0].tolist()
        finally:
            self.block_manager.free(seq)

    # -- offline ---------------------------------------------------------------
    def generate(
        self,
        prompts: Iterable[str | Seq[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[Completion]:
        """Run prompts to completion in one continuous batch; results in prompt order."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        completions: dict[str, Completion] = {}
        order = []
        for prompt, p in zip(prompts, params):
            request_id = self.add_request(prompt, p)
            order.append(request_id)
            completions[request_id] = Completion(request_id, list(self.scheduler.requests[request_id].prompt_token_ids))
        with tqdm(total=len(prompts), desc="Generating", unit="req", disable=not use_tqdm, leave=False) as bar:
            while self.has_unfinished_requests():
                for output in self.step():
                    completions[output.request_id].add(output)
                    if output.finished:
                        bar.update(1)
        return [completions[r] for r in order]


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda was asked for but no CUDA device is visible; use device=cpu")
    return torch.device(name)


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bf16 math (about 2x float32's
    speed there), float32 elsewhere."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    try:
        native_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        native_bf16 = False
    return torch.bfloat16 if native_bf16 else torch.float32
