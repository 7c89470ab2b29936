"""The settings of one load-generator run, in their own module because every other
part (workloads, transports, the runner) reads them and they are stored with results."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class BenchConfig:
    """Everything a run depends on; stored with its results."""

    url: str = "localhost:8001"
    protocol: str = "grpc"  # grpc | http | openai
    model_name: str = "llm"
    num_requests: int | None = 64
    duration: float | None = None  # seconds; overrides num_requests
    concurrency: int = 1  # closed loop
    request_rate: float | None = None  # requests/s; open loop when set
    prompt_len_mean: int = 128
    prompt_len_range: int = 64
    output_len: int = 64
    output_len_range: int = 0
    prompts_jsonl: str | None = None
    tokenizer: str | None = ""  # "": the bundled model's; None: none (approximate prompt lengths)
    seed: int = 0
    warmup: int = 2
    temperature: float = 0.0
    ignore_eos: bool = True
    request_timeout: float | None = 1800.0  # seconds for a whole request (a hung server must not hang the run)

    def validate(self) -> None:
        if self.protocol not in ("grpc", "http", "openai"):
            raise ValueError(f"protocol must be grpc, http or openai, got {self.protocol!r}")
        if self.duration is None and (self.num_requests is None or self.num_requests < 1):
            raise ValueError("give num_requests >= 1 or a duration")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"duration must be > 0, got {self.duration}")
        if self.request_rate is None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is not None and self.request_rate <= 0:
            raise ValueError(f"request rate must be > 0, got {self.request_rate}")
        if min(self.prompt_len_mean, self.output_len) < 1 or min(self.prompt_len_range, self.output_len_range, self.warmup) < 0:
            raise ValueError("lengths must be >= 1, ranges and warmup >= 0")

    @property
    def mode(self) -> str:
        return f"open loop, {self.request_rate:g} req/s" if self.request_rate else f"closed loop, concurrency {self.concurrency}"
