"""preprocessing / postprocessing, and the tensor copies every model relies on."""

from __future__ import annotations

import numpy as np

from pagedserve.backend.triton_adapter.stateless import PostprocessingModel, PreprocessingModel
from pagedserve.backend.triton_adapter.tensors import request_inputs, to_tensors

from .fakes import CharTokenizer, FakePbUtils, Request, TritonError


def test_preprocessing_answers_each_request_alone():
    model = PreprocessingModel(FakePbUtils(), CharTokenizer())
    good, bad, missing = Request({"QUERY": [["ab"]]}), Request({"QUERY": [[b"\xff"]]}), Request({})
    responses = model.execute([good, bad, missing])
    assert responses[0].outputs()["INPUT_ID"].tolist() == [[97, 98]]
    assert responses[0].outputs()["INPUT_ID"].dtype == np.int32
    assert [r.error().code() for r in responses[1:]] == [TritonError.INVALID_ARG] * 2
    assert "not valid UTF-8" in responses[1].error().message()
    assert "'QUERY'" in responses[2].error().message()


def test_preprocessing_gives_tensorrt_llm_word_lists_lengths_and_ids():
    model = PreprocessingModel(FakePbUtils(), CharTokenizer())
    request = Request({"QUERY": [["hi"], ["abc"]], "REQUEST_OUTPUT_LEN": [[5], [6]],
                       "STOP_WORDS_DICT": [["ab", "c"], ["x", ""]], "END_ID": [[7], [8]]})
    (response,) = model.execute([request])
    out = response.outputs()
    assert out["INPUT_ID"].tolist() == [[104, 105, 3], [97, 98, 99]]  # padded with the pad id (eos here)
    assert out["REQUEST_INPUT_LEN"].tolist() == [[2], [3]]
    assert out["STOP_WORDS_IDS"].tolist() == [[[97, 98, 99], [2, 3, -1]], [[120, 0, 0], [1, -1, -1]]]
    assert out["BAD_WORDS_IDS"].tolist() == [[[0], [-1]], [[0], [-1]]]
    assert out["OUT_END_ID"].tolist() == [[7], [8]] and out["OUT_PAD_ID"].tolist() == [[3], [3]]
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[5], [6]]


def test_preprocessing_refuses_embedding_bias_by_the_ensembles_name():
    model = PreprocessingModel(FakePbUtils(), CharTokenizer())
    (response,) = model.execute([Request({"QUERY": [["a"]], "EMBEDDING_BIAS_WORDS": [["x"]]})])
    assert "'embedding_bias_words'" in response.error().message()


def test_postprocessing_decodes_the_delta_after_its_context_minus_trimmed_chars():
    model = PostprocessingModel(FakePbUtils(), CharTokenizer())
    request = Request({"TOKENS_BATCH": [[[ord(c) for c in "lo STOP"]]], "SEQUENCE_LENGTH": [[7]],
                       "CONTEXT_IDS": [[[ord("l")]]], "CONTEXT_LENGTH": [[1]], "TRIM_CHARS": [[5]]})
    (response,) = model.execute([request])
    assert response.outputs()["OUTPUT"].tolist() == [b"lo"]


def test_postprocessing_cuts_each_beam_at_its_sequence_length_one_entry_per_beam():
    model = PostprocessingModel(FakePbUtils(), CharTokenizer())
    request = Request({"TOKENS_BATCH": [[[104, 105, 0], [111, 0, 0]]], "SEQUENCE_LENGTH": [[2, 1]]})
    (response,) = model.execute([request])
    assert response.outputs()["OUTPUT"].tolist() == [b"hi", b"o"]
    (bad,) = model.execute([Request({"TOKENS_BATCH": [[[104]]], "SEQUENCE_LENGTH": [[4]]})])
    assert "'SEQUENCE_LENGTH'" in bad.error().message()


def test_request_inputs_are_copies_out_of_shared_memory():
    request = Request({"input_ids": [1, 2, 3]})
    shared = request.inputs()[0].as_numpy()  # stands for the request's shared-memory region
    inputs = request_inputs(request)
    shared[:] = 0  # the backend frees / reuses it once execute() returns
    assert inputs["input_ids"].tolist() == [1, 2, 3]


def test_string_outputs_travel_as_utf8_bytes():
    (tensor,) = to_tensors(FakePbUtils(), {"text_output": np.array(["é", b"x"], dtype=np.object_)})
    assert tensor.as_numpy().tolist() == ["é".encode(), b"x"]
