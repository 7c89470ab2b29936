"""TensorRT-LLM's `decoupled_mode: false` deployment: with `tensorrt_llm` and
`tensorrt_llm_bls` not decoupled (one line each in their config.pbtxt), unary infer
works on them and on the ensemble, as TensorRT-LLM's end_to_end_test uses it."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from pagedserve.backend import SamplingParams
from pagedserve.client.repository import write_repository
from pagedserve.client.triton_server import TritonServer

from .conftest import ENGINE, tensor

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def unary_server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("unary")
    repository = write_repository(workdir / "repo", engine=ENGINE)
    for name in ("tensorrt_llm", "tensorrt_llm_bls"):
        config = repository / name / "config.pbtxt"
        config.write_text(config.read_text().replace("decoupled: true", "decoupled: false"))
    with TritonServer(repository, log_file=workdir / "server.log").start(timeout=300) as server:
        yield server


def http_tensor(name, value, dtype, shape):
    array = np.array(value, dtype=object if dtype == "BYTES" else {"INT32": np.int32, "BOOL": np.bool_}[dtype]).reshape(shape)
    if dtype == "BYTES":
        array = np.array([v.encode() for v in array.reshape(-1)], dtype=object).reshape(shape)
    t = httpclient.InferInput(name, shape, dtype)
    t.set_data_from_numpy(array)
    return t


def test_unary_infer_on_the_steps_the_ensemble_and_the_bls(unary_server, engine):
    [offline] = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    client = grpcclient.InferenceServerClient(unary_server.grpc_url)
    text_inputs = [tensor("text_input", PROMPT, shape=[1, 1]), tensor("max_tokens", 8, shape=[1, 1])]
    for model in ("ensemble", "tensorrt_llm_bls"):
        result = client.infer(model, text_inputs)
        assert result.as_numpy("text_output")[0].decode() == PROMPT + offline.text  # their default: the prompt comes along
    ids = engine.encode(PROMPT)
    result = client.infer("tensorrt_llm", [tensor("input_ids", ids, shape=[1, len(ids)]), tensor("input_lengths", len(ids), shape=[1, 1]),
                                           tensor("request_output_len", 8, shape=[1, 1]),
                                           tensor("exclude_input_in_output", True, shape=[1, 1])])
    assert result.as_numpy("output_ids").tolist() == [[offline.token_ids]]
    client.close()
    http = httpclient.InferenceServerClient(unary_server.http_url)
    reply = http.infer("ensemble", [http_tensor("text_input", [[PROMPT]], "BYTES", [1, 1]), http_tensor("max_tokens", [[8]], "INT32", [1, 1])])
    assert reply.as_numpy("text_output")[0].decode() == PROMPT + offline.text
    http.close()
