"""What the engine hands back: per step, per finished request, and its running totals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .sequence import TokenLogprob

if TYPE_CHECKING:
    from .scheduler import ScheduledBatch


@dataclass(slots=True)
class RequestOutput:
    """One request's progress in one step (a delta; the last one has finished=True).

    new_token_ids are released only at clean text boundaries, and
    context_token_ids are the few ids before them, so a stateless detokenizer
    (tokenizer.decode_delta) turns them into exactly `text`, minus
    `trim_chars` trailing characters that a stop string cut off.
    """

    request_id: str
    new_token_ids: list[int]
    context_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    trim_chars: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    """Output tokens released so far (cumulative)."""
    num_cached_tokens: int = 0
    cumulative_logprob: float | None = None
    error: str | None = None
    """Set when the engine failed while serving this request."""
    index: int = 0
    """Which sample of the request this is (n > 1)."""
    samples: list["RequestOutput"] = field(default_factory=list)
    """With n > 1: every sample's output of this step, by index (the fields above then
    describe the request as a whole: finished once every sample is)."""

    def per_sample(self) -> list["RequestOutput"]:
        """Each sample's output, by index (just this one when n = 1)."""
        return self.samples or [self]

    @property
    def num_new_tokens(self) -> int:
        """Tokens released this step, over all samples."""
        return sum(len(sample.new_token_ids) for sample in self.per_sample())


@dataclass
class Completion:
    """A finished request, as the offline `generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float | None = None
    num_cached_tokens: int = 0
    samples: list["Completion"] = field(default_factory=list)
    """With n > 1: each sample's completion, by index."""

    def add(self, output: RequestOutput) -> None:
        for sample in output.samples:
            while len(self.samples) <= sample.index:
                self.samples.append(Completion(self.request_id, self.prompt_token_ids))
            self.samples[sample.index].add(sample)
        self.text += output.text
        self.token_ids.extend(output.new_token_ids)
        self.logprobs.extend(output.logprobs)
        self.finish_reason = output.finish_reason
        self.cumulative_logprob = output.cumulative_logprob
        self.num_cached_tokens = output.num_cached_tokens


@dataclass
class StepCounts:
    """What the latest engine step ran (TensorRT-LLM's in-flight batcher metrics read it)."""

    iteration: int = 0
    context_requests: int = 0
    """Requests computing prompt tokens (a prefill chunk)."""
    context_tokens: int = 0
    generation_requests: int = 0
    """Requests decoding one token."""

    @classmethod
    def of(cls, batch: ScheduledBatch, iteration: int) -> StepCounts:
        """The counts of a batch, taken before it runs."""
        context = [n for seq, n in zip(batch.seqs, batch.num_new_tokens) if seq.num_computed_tokens < seq.num_prompt_tokens]
        return cls(iteration, len(context), sum(context), len(batch.seqs) - len(context))


@dataclass
class EngineStats:
    """The engine's queues, KV cache and running totals at one moment (LLMEngine.stats())."""

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
    num_recoveries: int = 0
    prefix_query_tokens: int = 0
    """Prompt tokens looked up in the prefix cache (forks of n > 1 included)."""
    prefix_hit_tokens: int = 0
    """Of those, tokens whose KV blocks were reused."""
    block_size: int = 16
    last_step: StepCounts = field(default_factory=StepCounts)
    max_lora: int = 0
    """LoRA adapters a step may run at once (max_loras; 0: LoRA off),"""
    running_lora_adapters: tuple[str, ...] = ()
    """the adapters running requests name,"""
    waiting_lora_adapters: tuple[str, ...] = ()
    """and those waiting requests name."""
    spec_num_drafts: int = 0
    """Speculative decoding (vLLM v1's vllm:spec_decode_* counters): request-steps that verified drafts,"""
    spec_num_draft_tokens: int = 0
    """the draft tokens verified,"""
    spec_num_accepted_tokens: int = 0
    """and those accepted;"""
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    """position i: request-steps that accepted at least i + 1 drafts."""
    spec_num_backed_off: int = 0
    """Request-steps where a request that could draft drafted nothing because its drafts were not
    expected to pay for their rows (`draft_length: adaptive`; spec_decode/draft_length.py);"""
    spec_row_cost: float = 0.0
    """what one more token row adds to a plain step's time at the last step's batch size, relative to
    that time, as measured (0 before it is)."""
