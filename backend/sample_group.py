"""SampleGroup: the n parallel samples of one request (vLLM's `n`).

Sample 0 prefills the prompt; the others fork from it once that prompt is in the
cache, taking its full prompt blocks by reference (the block manager's ref counts)
and computing only the last partial block themselves. Each sample then decodes on
its own; the request gets one output per step holding every sample's delta, and
ends when all samples have.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .outputs import RequestOutput
from .sequence import Sequence


def sample_id(request_id: str, index: int) -> str:
    """The scheduler's id of sample `index` of a request."""
    return f"{request_id}#{index}"


@dataclass
class SampleGroup:
    request_id: str
    samples: list[Sequence]
    forks_waiting: list[Sequence] = field(default_factory=list)
    """Samples not yet handed to the scheduler: they wait for sample 0's prompt."""
    last: dict[int, RequestOutput] = field(default_factory=dict)
    """Each sample's latest output, to repeat (without new tokens) while it is quiet."""
    final_only: bool = False
    """Its caller reads the finished output alone (LLMEngine.add_request)."""

    @classmethod
    def fork(cls, request_id: str, first: Sequence, n: int, final_only: bool = False) -> SampleGroup:
        """A group whose samples 1..n-1 copy `first` (prompt and its images, parameters, arrival)."""
        forks = [
            Sequence(sample_id(request_id, i), list(first.prompt_token_ids), first.params,
                     arrival_time=first.arrival_time, sample_index=i, fork_of=first, mm=first.mm)
            for i in range(1, n)
        ]
        return cls(request_id, [first, *forks], forks_waiting=list(forks), final_only=final_only)

    def forks_ready(self) -> list[Sequence]:
        """Samples that may start now: sample 0's prompt is computed (or it ended)."""
        first = self.samples[0]
        if self.forks_waiting and (first.num_computed_tokens >= first.num_prompt_tokens or first.is_finished):
            ready, self.forks_waiting = self.forks_waiting, []
            return ready
        return []

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.samples)

    def merge(self, outputs: dict[int, RequestOutput]) -> RequestOutput:
        """One output for the request: every sample's delta this step, in index order."""
        samples = []
        for index, seq in enumerate(self.samples):
            output = outputs.get(index) or self._quiet(index, seq)
            output.request_id, output.index = self.request_id, index
            self.last[index] = output
            samples.append(output)
        first = samples[0]
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=[],
            context_token_ids=[],
            text="",
            finished=self.finished,
            finish_reason=first.finish_reason if self.finished else None,
            num_prompt_tokens=first.num_prompt_tokens,
            num_output_tokens=sum(s.num_output_tokens for s in samples),
            num_cached_tokens=max(s.num_cached_tokens for s in samples),
            samples=samples,
        )

    def _quiet(self, index: int, seq: Sequence) -> RequestOutput:
        """A sample with nothing new this step: no tokens, its state as last reported."""
        last = self.last.get(index)
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=[],
            context_token_ids=[],
            text="",
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.is_finished and seq.finish_reason else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=last.num_output_tokens if last else 0,
            num_cached_tokens=seq.num_cached_tokens,
            cumulative_logprob=last.cumulative_logprob if last else None,
        )


class SampleGroups:
    """Every request with n > 1, and which request each of their samples belongs to."""

    def __init__(self) -> None:
        self.groups: dict[str, SampleGroup] = {}
        self._request_of_sample: dict[str, str] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def __bool__(self) -> bool:
        return bool(self.groups)

    def add(self, group: SampleGroup) -> None:
        self.groups[group.request_id] = group
        self._request_of_sample.update((seq.request_id, group.request_id) for seq in group.samples)

    def pop(self, request_id: str) -> SampleGroup | None:
        group = self.groups.pop(request_id, None)
        for seq in group.samples if group else ():
            self._request_of_sample.pop(seq.request_id, None)
        return group

    def clear(self) -> None:
        self.groups.clear()
        self._request_of_sample.clear()

    def forks_ready(self) -> list[tuple[SampleGroup, Sequence]]:
        """Samples of every group that may start now, each with its group."""
        return [(group, fork) for group in self.groups.values() for fork in group.forks_ready()]

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One output per request: each group's sample outputs merged; finished groups forgotten."""
        merged: list[RequestOutput] = []
        by_group: dict[str, dict[int, RequestOutput]] = {}
        for output in outputs:
            request_id = self._request_of_sample.get(output.request_id)
            if request_id is None:
                merged.append(output)
            else:
                by_group.setdefault(request_id, {})[output.index] = output
        for request_id, samples in by_group.items():
            group = self.groups[request_id]
            merged.append(group.merge(samples))
            if group.finished:
                self.pop(request_id)
        return merged
