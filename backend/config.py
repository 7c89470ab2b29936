"""EngineConfig: every engine setting in one dataclass, validated once.

The same dataclass is fed from config.pbtxt parameters, the CLI and the Python
API; `from_strings` is the one parser for the string-valued sources.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ConfigError
from .values import setting_items, to_bool, to_float, to_int

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("inflight", "static")
QUANTIZATIONS = ("none", "fp8", "int4")
KV_CACHE_DTYPES = ("auto", "fp8")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
COMPILE_MODES = ("auto", "on", "off")
LOAD_FORMATS = ("auto", "dummy")
ASYNC_SCHEDULING = ("auto", "on", "off")
LORA_RANKS = (8, 16, 32, 64, 128, 256)


@dataclass
class EngineConfig:
    """Settings of one engine instance. Unset model means the bundled default model."""

    model: str = ""
    """Hugging Face model directory or .gguf file; empty: bundled SmolLM2-135M-Instruct."""
    load_format: str = "auto"
    """auto reads the checkpoint's weights; dummy gives random weights of the checkpoint's shape (only its
    config and tokenizer are read), as vLLM's `--load-format dummy`: for speed measurements of a model too
    large to ship (benchmarks/gpu.py)."""
    dtype: str = "auto"
    """Compute and KV dtype: auto (bfloat16 on CUDA; on CPU, bfloat16 where the flags show native bf16 math
    (avx512_bf16, amx_bf16, Arm bf16) and it measures faster than float32 on the model's matmul shape at
    start-up, else float32), float32, bfloat16, float16."""
    device: str = "auto"
    """auto (cuda when available), cpu or cuda."""
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_bytes: int = 512 * 1024**2
    """KV cache budget in bytes on CPU."""
    gpu_memory_utilization: float = 0.90
    """Fraction of total GPU memory pagedserve may use; the KV cache gets what the weights leave of it."""
    num_kv_blocks: int = 0
    """Exact number of KV blocks; 0 derives it from the budgets above."""
    max_num_seqs: int = 64
    """Most requests running at once (also the static batch size)."""
    max_num_batched_tokens: int = 2048
    """Per-step token budget shared by prefill chunks and decodes."""
    max_model_len: int = 0
    """Longest prompt + output in tokens; 0 takes the model's context length."""
    enable_prefix_caching: bool = True
    """Reuse cached KV blocks of identical prompt prefixes."""
    max_queue_size: int = 1024
    """Most requests waiting; beyond it new requests are refused ("busy, retry later")."""
    seed: int = 0
    """Seed of the engine's random generator (requests without their own seed)."""
    max_stop_strings: int = 64
    """Most stop strings one request may give: each is looked for in its text after every token, on the engine's thread."""
    max_stop_chars: int = 512
    """Longest stop string, in characters."""
    max_bad_words: int = 256
    """Most bad words one request may give (`bad_words` and `bad_words_ids` together): each is checked at every step."""
    step_timeout_s: float = 300.0
    """A served engine step running longer than this is taken as hung (a stuck device or kernel): its requests
    fail, new ones are refused and the model reports not ready (`/v2/models/<name>/ready`, where the Triton
    release asks the model) until the step returns and the engine is rebuilt. 0: never. Generous by default
    because a step may compile a kernel the first time it meets a shape."""
    stream_interval: int = 1
    """Tokens gathered into each streamed delta, as vLLM's `--stream-interval`: 1 streams every token as it is
    sampled; N > 1 sends a request's delta once N new tokens are waiting (the first and the last at once), so
    under load fewer responses carry the same tokens (less per-response work for the server and the client;
    benchmarks/RESULTS.md). A request's `stream_interval` sampling parameter may raise it."""
    scheduling_policy: str = "inflight"
    """inflight (continuous batching) or static (kept for benchmarks only)."""
    quantization: str = "none"
    """Weight quantization applied on load: none, fp8 or int4."""
    kv_cache_dtype: str = "auto"
    """KV cache storage: auto (the compute dtype) or fp8 (e4m3 with scales)."""
    attention_backend: str = "auto"
    """auto (Triton kernel on CUDA, the CPU attention on CPU), cpu (kernels/cpu/paged_attention.py; CPU only),
    torch (the reference, kernels/paged_attention.py: the oracle the others are tested against), or triton."""
    num_threads: int = 0
    """CPU threads for torch; 0 keeps torch's default (all cores)."""
    compile: str = "auto"
    """The compiled step (backend/compiled_forward.py): torch.compile of each layer's work between its
    attentions, warmed up at load; and on CUDA every decode step replayed as one CUDA graph per batch-size
    bucket (backend/cuda_graphs.py; quantized models too). auto: compiled on CUDA where it is implemented
    (unquantized weights, one rank) and CUDA graphs on CUDA with one rank; off on CPU, where the eager step
    with oneDNN-packed weights measured faster (benchmarks/RESULTS.md). on: compiled (refused where not
    implemented); off: eager everywhere, no CUDA graphs."""
    async_scheduling: str = "auto"
    """Schedule and prepare step k+1 on the CPU while the device runs step k, applying step k's tokens after
    (vLLM's async scheduling): the host's work per step hides behind the device's. auto: on CUDA with one
    rank; on, off. Requests whose sampling needs every earlier token on the host (penalties, bad words,
    min_tokens, logprobs) run their steps one after the other either way."""
    deterministic: bool = False
    """Greedy answers that do not depend on the batch (vLLM's and SGLang's batch-invariant mode): a
    request gives the same tokens alone or beside others, whatever their lengths, because every row
    count multiplies the same weights in the same order. In half precision a weight rounded from GGUF
    blocks (the bundled model's) multiplies its exact blocks in float32 for a step of a few rows and
    the rounded weight for more, so such a step's logits differ in the last bits; true keeps the
    rounded weight for every row count, which costs a single stream's decode speed (measured
    in benchmarks/RESULTS.md); and a float32 weight is packed for oneDNN whatever the probe measured
    faster, since MKL and the few-row GEMV order a few rows' sums differently. On CUDA the linears,
    norms, attention, MoE kernels and logprobs run batch-invariant Triton launches (backend/
    batch_invariant.py) with the decode CUDA graphs but no torch.compile; their cost is a section of
    benchmarks/gpu.py. Unquantized weights on one rank: refused with quantization, compile=on or
    several ranks."""
    enable_lora: bool = False
    """Serve LoRA adapters (vLLM's --enable-lora): requests name one by `lora_name` in their sampling
    parameters, and requests of different adapters and the base model batch together (backend/lora/).
    Eager steps on one rank: refused with compile=on, several ranks or deterministic; with auto the step
    is not compiled (CUDA graphs still replay the steps without adapter rows)."""
    lora_modules: str = ""
    """The adapters: a JSON file of name -> PEFT adapter folder (Triton's vLLM backend's multi_lora.json;
    relative folders are read beside the file), or `name=folder,name=folder`. Empty with enable_lora: the
    Triton model reads multi_lora.json in its version folder, as Triton's vLLM backend does."""
    max_loras: int = 4
    """Adapters on the device at once (vLLM's --max-loras): a step's requests use at most this many; a
    request for another one waits in the queue until a slot's requests finish."""
    max_lora_rank: int = 16
    """Largest adapter rank served (vLLM's --max-lora-rank): every slot is this wide; an adapter of a
    higher rank is refused at load, naming it."""
    max_cpu_loras: int = 0
    """Adapters kept read in host memory, least recently used dropped first (vLLM's --max-cpu-loras);
    0: max_loras."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (Megatron-style tensor parallelism): one process per rank, each holding
    its share of the weights and of the KV cache; rank 0 runs the engine and spawns the others. Must divide
    the attention heads, the intermediate size and the vocabulary. On CUDA one GPU per rank (NCCL), on CPU
    gloo."""
    speculative_config: str | dict = ""
    """Speculative decoding (vLLM's --speculative-config): a dict (Python API), a JSON object or
    `key=value,key=value` (config.pbtxt, `pagedserve serve --set`) of vLLM's keys `method` ("ngram",
    prompt lookup, "draft_model" or "eagle3"), `num_speculative_tokens` (required, >= 1), `prompt_lookup_min` and
    `prompt_lookup_max` (both unset: 5 and 5; one unset: the other's value), `model` (the draft's
    checkpoint or the EAGLE-3 head's; given alone it means draft_model), `draft_tensor_parallel_size` (1), `disable_by_batch_size`
    (no drafting while more than that many requests run), and pagedserve's `draft_length` (adaptive: only
    the drafts expected to pay for their rows; fixed) and `dtype` (the draft's; auto: the target's).
    Greedy and sampled requests (logit processors and structured outputs included) verify their drafts in
    the step's flat batch and give exactly the tokens they give without it (docs/engine-settings.md).
    Empty: off. Refused with async_scheduling=on and several ranks; async_scheduling=auto is off while
    speculating."""
    kv_events_config: str | dict = ""
    """The prefix cache's events for LLM-aware routers (vLLM's --kv-events-config, backend/kv_events.py):
    a dict, a JSON object or `key=value,key=value` of vLLM's keys `enable_kv_cache_events` (default true
    once set), `publisher` (zmq), `endpoint` (where the PUB socket binds; default tcp://*:5557) and
    `topic`. Empty: off. Needs pyzmq and msgpack (`pip install 'pagedserve[kv-events]'`)."""
    limit_mm_per_prompt: str | dict = ""
    """Most images one prompt of a vision-language model may carry (vLLM's --limit-mm-per-prompt): a dict,
    a JSON object or `image=N`; empty: 8."""
    max_image_pixels: int = 4096 * 4096
    """Largest image (width x height) a vision-language model takes, checked from the file's header before
    any pixel is decoded (a small file may claim a huge picture)."""
    mm_processor_kwargs: str | dict = ""
    """Settings of the checkpoint's image processor for every prompt (vLLM's --mm-processor-kwargs), e.g.
    Gemma 3's `do_pan_and_scan` (crops of a wide or tall image beside it) or Qwen2.5-VL's `max_pixels`:
    a dict, a JSON object or `key=value,key=value` (values read as JSON where they parse: true, 8);
    each key must be one of the image processor's settings. Empty: the checkpoint's own."""
    max_num_encoder_input_tokens: int = 0
    """Image tokens a step may encode (vLLM's encoder budget): a prefill chunk stops before an image
    past it, which a later step encodes, so many images do not stall the batch's decodes at once; an
    image larger than this still runs, alone. 0: max_num_batched_tokens."""
    encoder_cache_bytes: int = 256 * 2**20
    """Bytes of image embeddings kept by image content (a conversation that resends an image is not
    encoded again); least recently used dropped first."""

    def __post_init__(self) -> None:
        self._coerce_types()
        self._validate()

    # -- construction from strings (config.pbtxt, CLI) -------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_strings(cls, values: Mapping[str, Any]) -> "EngineConfig":
        """Build from string-valued settings; unknown names are an error naming them."""
        known = set(cls.field_names())
        unknown = sorted(k for k in values if k not in known)
        if unknown:
            raise ConfigError(
                unknown[0],
                f"unknown parameter(s) {unknown}; known parameters: {sorted(known)}",
            )
        return cls(**dict(values))

    def _coerce_types(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = f.type if isinstance(f.type, str) else f.type.__name__
            try:
                setattr(self, f.name, _coerce(value, kind))
            except (TypeError, ValueError):
                raise ConfigError(f.name, f"expected {kind}, got {value!r}") from None

    def _validate(self) -> None:
        _choice(self, "dtype", DTYPES)
        _choice(self, "device", DEVICES)
        _choice(self, "scheduling_policy", POLICIES)
        _choice(self, "quantization", QUANTIZATIONS)
        _choice(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        _choice(self, "attention_backend", ATTENTION_BACKENDS)
        _choice(self, "compile", COMPILE_MODES)
        _choice(self, "load_format", LOAD_FORMATS)
        _choice(self, "async_scheduling", ASYNC_SCHEDULING)
        if self.compile == "on" and not self.compile_supported:
            raise ConfigError(
                "compile",
                "the compiled step runs unquantized weights on one rank; set compile='auto' or 'off' "
                f"(quantization={self.quantization!r}, tensor_parallel_size={self.tensor_parallel_size})",
            )
        if self.deterministic and (self.quantization != "none" or self.compile == "on"):
            raise ConfigError("deterministic", "is implemented for the eager step of unquantized weights; set "
                                               f"quantization='none' and compile='auto' or 'off' (quantization="
                                               f"{self.quantization!r}, compile={self.compile!r})")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError("block_size", f"must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        _at_least(self, "kv_cache_bytes", 1024**2)
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ConfigError(
                "gpu_memory_utilization",
                f"must be in [0.05, 0.99], got {self.gpu_memory_utilization}",
            )
        _at_least(self, "num_kv_blocks", 0)
        _at_least(self, "max_num_seqs", 1)
        _at_least(self, "max_num_batched_tokens", 16)
        _at_least(self, "max_model_len", 0)
        _at_least(self, "max_queue_size", 1)
        _at_least(self, "step_timeout_s", 0)
        if not math.isfinite(self.step_timeout_s):
            raise ConfigError("step_timeout_s", f"must be a number of seconds (0: never), got {self.step_timeout_s}")
        for name in ("max_stop_strings", "max_stop_chars", "max_bad_words"):
            _at_least(self, name, 0)
        _at_least(self, "stream_interval", 1)
        _at_least(self, "num_threads", 0)
        _at_least(self, "tensor_parallel_size", 1)
        self._validate_lora()
        self._validate_speculative()
        self._validate_images()
        from .kv_events import parse as parse_kv_events

        self.kv_events = parse_kv_events(self.kv_events_config)
        """The parsed kv_events_config, None when off."""
        if self.tensor_parallel_size > 1:
            self._validate_tensor_parallel()
        if self.model and not os.path.exists(self.model):
            raise ConfigError(
                "model",
                f"{self.model!r} does not exist; give a Hugging Face model directory "
                "or a .gguf file, or leave it empty for the bundled default model",
            )

    def _validate_lora(self) -> None:
        _at_least(self, "max_loras", 1)
        _at_least(self, "max_cpu_loras", 0)
        if self.max_lora_rank not in LORA_RANKS:
            raise ConfigError("max_lora_rank", f"must be one of {list(LORA_RANKS)}, got {self.max_lora_rank}")
        if not self.enable_lora:
            if self.lora_modules:
                raise ConfigError("lora_modules", "lists adapters but enable_lora is false; set enable_lora=true")
            return
        for name, neutral in (("compile", ("auto", "off")), ("tensor_parallel_size", (1,)), ("deterministic", (False,))):
            if getattr(self, name) not in neutral:
                raise ConfigError("enable_lora", f"adapters run in the eager step on one rank, their deltas in "
                                                 f"batches of any size (not batch-invariant); set {name} to "
                                                 f"{' or '.join(map(repr, neutral))} (got {getattr(self, name)!r})")

    def _validate_images(self) -> None:
        limits = setting_items("limit_mm_per_prompt", self.limit_mm_per_prompt) if self.limit_mm_per_prompt else {}
        unknown = set(limits) - {"image"}
        if unknown:
            raise ConfigError("limit_mm_per_prompt", f"only `image` is taken, got {sorted(unknown)}")
        try:
            self.max_images_per_prompt = int(limits.get("image", 8))
            """The parsed limit_mm_per_prompt's image count."""
        except (TypeError, ValueError):
            raise ConfigError("limit_mm_per_prompt", f"image: a whole number, got {limits['image']!r}") from None
        if self.max_images_per_prompt < 0:
            raise ConfigError("limit_mm_per_prompt", f"image: must be >= 0, got {self.max_images_per_prompt}")
        self.processor_kwargs = {key: _json_or_text(value) for key, value in
                                 setting_items("mm_processor_kwargs", self.mm_processor_kwargs).items()} \
            if self.mm_processor_kwargs else {}
        """The parsed mm_processor_kwargs (checked against the image processor when it loads)."""
        _at_least(self, "max_image_pixels", 1)
        _at_least(self, "max_num_encoder_input_tokens", 0)
        _at_least(self, "encoder_cache_bytes", 0)

    def _validate_speculative(self) -> None:
        from .spec_decode.config import parse

        self.speculative = parse(self.speculative_config)
        """The parsed speculative_config, None when off."""
        if self.speculative is None:
            return
        if self.async_scheduling not in ("auto", "off"):
            raise ConfigError("speculative_config", f"is implemented for synchronous steps; set async_scheduling to "
                                                    f"'auto' or 'off' (got {self.async_scheduling!r})")
        if self.speculative.method == "eagle3" and self.tensor_parallel_size != 1:
            raise ConfigError("speculative_config", f"method 'eagle3' runs on one rank (its head reads the target's "
                                                    f"states on rank 0); set tensor_parallel_size to 1 (got "
                                                    f"{self.tensor_parallel_size!r}), or use 'ngram' or 'draft_model'")

    @property
    def compile_supported(self) -> bool:
        return self.quantization == "none" and self.tensor_parallel_size == 1

    def _validate_tensor_parallel(self) -> None:
        """Settings whose sharded form is not implemented (the model's shapes are checked at load)."""
        for name, neutral in (("quantization", "none"), ("kv_cache_dtype", "auto"), ("async_scheduling", "auto"),
                              ("deterministic", False)):
            value = getattr(self, name)
            if value != neutral:
                raise ConfigError(
                    "tensor_parallel_size",
                    f"{self.tensor_parallel_size} ranks with {name}={value!r} is not supported (quantized weights "
                    f"and KV are not sharded; ranks step in lockstep); set {name}={neutral!r} or tensor_parallel_size=1",
                )


def _json_or_text(value: Any) -> Any:
    """A `key=value` setting's value as JSON where it parses (true, 8, 0.5), else the text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _coerce(value: Any, kind: str) -> Any:
    casts = {"bool": to_bool, "int": to_int, "float": to_float, "str": lambda v: str(v).strip()}
    return casts[kind](value) if kind in casts else value


def _choice(config: EngineConfig, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in allowed:
        raise ConfigError(name, f"must be one of {list(allowed)}, got {value!r}")


def _at_least(config: EngineConfig, name: str, low: int) -> None:
    value = getattr(config, name)
    if value < low:
        raise ConfigError(name, f"must be >= {low}, got {value}")
