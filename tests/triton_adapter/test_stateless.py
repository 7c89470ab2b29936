"""preprocessing / postprocessing, and the tensor copies every model relies on."""

from __future__ import annotations

import numpy as np

from pagedserve.backend.triton_adapter.stateless import PostprocessingModel, PreprocessingModel
from pagedserve.backend.triton_adapter.tensors import request_inputs, to_tensors

from .fakes import CharTokenizer, FakePbUtils, Request, TritonError


def test_preprocessing_answers_each_request_alone():
    model = PreprocessingModel(FakePbUtils(), CharTokenizer())
    good, bad, missing = Request({"text_input": "ab"}), Request({"text_input": b"\xff"}), Request({})
    responses = model.execute([good, bad, missing])
    assert responses[0].outputs()["input_ids"].tolist() == [97, 98]
    assert responses[0].outputs()["input_ids"].dtype == np.int32
    assert [r.error().code() for r in responses[1:]] == [TritonError.INVALID_ARG] * 2
    assert "not valid UTF-8" in responses[1].error().message()
    assert "'text_input'" in responses[2].error().message()


def test_postprocessing_decodes_the_delta_after_its_context_minus_trimmed_chars():
    model = PostprocessingModel(FakePbUtils(), CharTokenizer())
    request = Request({"output_ids": [ord(c) for c in "lo STOP"], "context_ids": [ord("l")], "trim_chars": 5})
    (response,) = model.execute([request])
    assert response.outputs()["text_output"].tolist() == [b"lo"]


def test_request_inputs_are_copies_out_of_shared_memory():
    request = Request({"input_ids": [1, 2, 3]})
    shared = request.inputs()[0].as_numpy()  # stands for the request's shared-memory region
    inputs = request_inputs(request)
    shared[:] = 0  # the backend frees / reuses it once execute() returns
    assert inputs["input_ids"].tolist() == [1, 2, 3]


def test_string_outputs_travel_as_utf8_bytes():
    (tensor,) = to_tensors(FakePbUtils(), {"text_output": np.array(["é", b"x"], dtype=np.object_)})
    assert tensor.as_numpy().tolist() == ["é".encode(), b"x"]
