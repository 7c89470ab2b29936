"""The client contracts our models speak: what the engine is asked for a client's
request (its token-level tensors), and which responses the client gets for each
engine response. `llm` speaks VllmText in the engine's own process (engine_model.py);
the relays (relay_model.py) speak the others over BLS to `llm`.

- VllmText (`llm`): Triton's vLLM backend's tensors, text in and out.
- EngineTokens (`llm_engine`): the engine's token-level tensors, passed on unchanged.
- TrtllmText (`tensorrt_llm_bls`): TensorRT-LLM's text-level tensors.
- TrtllmTokens (`tensorrt_llm`): TensorRT-LLM's token-level tensors, the middle step
  of the `ensemble`; it also sends the context ids `postprocessing` needs for exact text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Protocol

import numpy as np

from ..errors import InvalidRequestError
from ..tokenizer import encode_prompt
from ..values import to_bool
from .finals import ERROR_OUTPUT
from .requests import CORE_OUTPUTS, parse_prompt, requested_returns, select_outputs
from .responses import (
    ENGINE_OUTPUTS,
    TEXT_LEVEL_INPUTS,
    client_response,
    postprocess_texts,
    split_samples,
    text_response,
)
from .tensors import Arrays, flag, scalar, token_ids
from .trtllm import (
    TEXT_NAMES,
    TOKEN_NAMES,
    engine_inputs,
    keep,
    parse_trtllm_request,
    prompt_token_ids,
    sample_outputs,
    samples_to_send,
    single_request,
    stop_words_of,
)

Reply = Callable[[Arrays], list[dict[str, np.ndarray]]]
RenderedReply = Callable[[Arrays, list[str]], list[dict[str, np.ndarray]]]


@dataclass
class RelayPlan:
    """How one client request travels: the engine's token-level inputs and outputs, and
    `reply`, which turns an engine response into the client's responses (maybe several, or none)."""

    engine_inputs: dict[str, np.ndarray] = field(default_factory=dict)
    engine_outputs: list[str] = field(default_factory=list)
    reply: Reply = lambda outputs: []
    rendered_reply: RenderedReply | None = None
    """In the engine's own process: the client's responses from an engine response's client-level
    outputs and each sample's text as the engine rendered it (the same text `reply` decodes again
    from the token ids), where the request's text excludes its prompt; None: `reply` only."""
    stops: bool = False
    """A TensorRT-LLM `stop` request: end the client's request of the same id; nothing to relay."""


class Contract(Protocol):
    def plan(self, inputs: Arrays, requested: set[str], tokenizer: Any) -> RelayPlan: ...

    def configured(self, parameters: Mapping[str, str]) -> Contract: ...


@dataclass(frozen=True)
class VllmText:
    """`llm`: tokenizes (or renders the chat), hands the rest to the engine unchanged."""

    def configured(self, parameters: Mapping[str, str]) -> VllmText:
        return self

    def plan(self, inputs: Arrays, requested: set[str], tokenizer: Any) -> RelayPlan:
        return self.plan_tokens(inputs, requested, tokenizer, parse_prompt(inputs, tokenizer))

    def plan_tokens(self, inputs: Arrays, requested: set[str], tokenizer: Any, prompt_ids: list[int]) -> RelayPlan:
        """`plan` for a prompt tokenized already (with its images: the engine's processor did it)."""
        extras = select_outputs(requested, requested_returns(inputs), ())
        forwarded = {name: array for name, array in inputs.items() if name not in TEXT_LEVEL_INPUTS}
        forwarded["input_ids"] = np.asarray(prompt_ids, dtype=np.int32)
        needed = {*CORE_OUTPUTS, ERROR_OUTPUT, *extras}
        with_text = "text_output" in requested
        return RelayPlan(
            engine_inputs=forwarded,
            engine_outputs=[name for name in ENGINE_OUTPUTS if name in needed],
            reply=lambda outputs: [text_response(outputs, tokenizer, with_text)],
            rendered_reply=lambda outputs, texts: [client_response(outputs, texts if with_text else None)],
        )


@dataclass(frozen=True)
class EngineTokens:
    """`llm_engine`: the engine's token-level tensors, relayed to `llm` unchanged."""

    def configured(self, parameters: Mapping[str, str]) -> EngineTokens:
        return self

    def plan(self, inputs: Arrays, requested: set[str], tokenizer: Any) -> RelayPlan:
        if "input_ids" not in inputs:  # without it `llm` would read the request as text
            raise InvalidRequestError("input_ids", "is required: llm_engine takes token ids (send text to `llm`)")
        needed = {*requested, "finished", ERROR_OUTPUT}
        return RelayPlan(
            engine_inputs=dict(inputs),
            engine_outputs=[name for name in ENGINE_OUTPUTS if name in needed],
            reply=lambda outputs: [{name: array for name, array in outputs.items() if name in requested}],
        )


TRTLLM_ENGINE_OUTPUTS = [*CORE_OUTPUTS, "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens", ERROR_OUTPUT]


@dataclass(frozen=True)
class _Trtllm:
    """What TensorRT-LLM's two relay contracts share: its sampling inputs, and one response
    per sequence (per sample with new ids when streaming) carrying its per-sequence outputs."""

    exclude_input_default: bool = False
    """The model parameter `exclude_input_in_output` (false, as there)."""
    names: ClassVar[Mapping[str, str]] = TEXT_NAMES

    def configured(self, parameters: Mapping[str, str]) -> _Trtllm:
        return dataclasses.replace(self, exclude_input_default=to_bool(parameters.get("exclude_input_in_output") or "false"))

    def plan(self, inputs: Arrays, requested: set[str], tokenizer: Any) -> RelayPlan:
        prompt, stop, bad = self.read(inputs, tokenizer)
        request = parse_trtllm_request(inputs, self.names, stop, bad, self.exclude_input_default)

        def reply(outputs: Arrays) -> list[dict[str, np.ndarray]]:
            ids = split_samples(outputs, "output_ids", "output_lengths")
            own = self.sequence_outputs(outputs, ids, tokenizer)
            return [
                keep({**own[i], **sample_outputs(outputs, i, ids[i])}, requested) for i in samples_to_send(ids, request.stream)
            ]

        return RelayPlan(engine_inputs(request, prompt), TRTLLM_ENGINE_OUTPUTS, reply)

    def read(self, inputs: Arrays, tokenizer: Any) -> tuple[list[int], list[str], list[list[int]]]:
        """The prompt's ids, stop words as strings, bad words as ids."""
        raise NotImplementedError

    def sequence_outputs(self, outputs: Arrays, ids: list[list[int]], tokenizer: Any) -> list[dict[str, np.ndarray]]:
        """This contract's own outputs of each sequence of an engine response."""
        raise NotImplementedError


@dataclass(frozen=True)
class TrtllmText(_Trtllm):
    """`tensorrt_llm_bls`: TensorRT-LLM's text in and out, tokenized here (one hop to
    the engine, and the client's cancellation reaches it)."""

    def read(self, inputs: Arrays, tokenizer: Any) -> tuple[list[int], list[str], list[list[int]]]:
        single_request(inputs, "text_input")
        text = scalar(inputs, "text_input")
        if not text:
            raise InvalidRequestError("text_input", "is required and must not be empty")
        return (encode_prompt(tokenizer, text), *stop_words_of(inputs, tokenizer, token_level=False))

    def sequence_outputs(self, outputs: Arrays, ids: list[list[int]], tokenizer: Any) -> list[dict[str, np.ndarray]]:
        # 1-D, one entry per beam, as TensorRT-LLM sends it (its clients read text_output[0])
        return [{"text_output": np.array([text], dtype=np.object_)} for text in postprocess_texts(outputs, tokenizer)]


@dataclass(frozen=True)
class TrtllmTokens(_Trtllm):
    """`tensorrt_llm`: TensorRT-LLM's token-level tensors (output_ids [batch, beam, len])."""

    names: ClassVar[Mapping[str, str]] = TOKEN_NAMES

    def plan(self, inputs: Arrays, requested: set[str], tokenizer: Any) -> RelayPlan:
        return RelayPlan(stops=True) if flag(inputs, "stop") else super().plan(inputs, requested, tokenizer)

    def read(self, inputs: Arrays, tokenizer: Any) -> tuple[list[int], list[str], list[list[int]]]:
        return (prompt_token_ids(inputs), *stop_words_of(inputs, tokenizer, token_level=True))

    def sequence_outputs(self, outputs: Arrays, ids: list[list[int]], tokenizer: Any) -> list[dict[str, np.ndarray]]:
        context = split_samples(outputs, "context_ids", "context_lengths")
        trims = token_ids(outputs, "trim_chars")
        skip = flag(outputs, "skip_special_tokens", default=True)
        return [{
            "output_ids": np.asarray(ids[i], dtype=np.int32).reshape(1, 1, -1),
            "sequence_length": np.array([[len(ids[i])]], dtype=np.int32),
            "context_ids": np.asarray(context[i], dtype=np.int32).reshape(1, 1, -1),
            "context_length": np.array([[len(context[i])]], dtype=np.int32),
            "trim_chars": np.array([[trims[i]]], dtype=np.int32),
            "skip_special_tokens": np.array([[skip]], dtype=np.bool_),
        } for i in range(len(ids))]
