"""LoRA adapters through a real tritonserver, as Triton's vLLM backend serves them: multi_lora.json in
the llm model's version folder, `lora_name` in sampling_parameters (gRPC, and HTTP's generate endpoint), `lora_task_id` on
the TensorRT-LLM ensemble (the adapter listed under that number), and `pagedserve openai` offering each
adapter as a model of its own (`model` names it, /v1/models lists it). Each gives the offline engine's
greedy text with that adapter; an unknown adapter is refused by name and the server keeps serving."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

from pagedserve.backend import LLMEngine, SamplingParams
from pagedserve.client.process import ServerProcess, free_port, http_status
from pagedserve.client.repository import write_repository
from pagedserve.client.triton_server import TritonServer

from ..lora_checks import write_adapters
from .conftest import llm_inputs, stream_request, tensor, texts, wait_idle

PROMPTS = ["The quick brown fox jumps over", "Printers in Venice, Paris and Antwerp"]


def test_adapters_are_served_by_name_on_every_contract(tmp_path, small_llama):
    listing, _ = write_adapters(small_llama, tmp_path / "adapters")
    folders = {name: str(tmp_path / "adapters" / folder) for name, folder in json.loads(open(listing).read()).items()}
    folders["7"] = folders["q-and-v"]  # lora_task_id 7 on the TensorRT-LLM models
    offline = LLMEngine(model=small_llama, dtype="float32", enable_lora=True,
                        lora_modules=",".join(f"{n}={f}" for n, f in folders.items()))
    params = {name: SamplingParams(max_tokens=8, temperature=0, ignore_eos=name != "7", lora_name=name) for name in folders}
    expected = {(name, prompt): offline.generate([prompt], p, use_tqdm=False)[0].text
                for name, p in params.items() for prompt in PROMPTS}
    base = offline.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert base[0].text != expected[("q-and-v", PROMPTS[0])]  # the adapter changes the answer

    repository = write_repository(tmp_path / "repo", model=small_llama, engine={"dtype": "float32", "enable_lora": "true"})
    (repository / "llm" / "1" / "multi_lora.json").write_text(json.dumps(folders))
    models = ["llm", "preprocessing", "tensorrt_llm", "postprocessing", "ensemble"]
    with TritonServer(repository, log_file=tmp_path / "server.log", models=models).start(timeout=300) as server:
        for name in ("every-projection", "q-and-v", "mlp-rslora"):  # gRPC, streamed
            for prompt in PROMPTS:
                results, error = stream_request(server, llm_inputs(prompt, max_tokens=8, temperature=0, ignore_eos=True,
                                                                   lora_name=name))
                assert error is None and "".join(texts(results)) == expected[(name, prompt)]
        sampling = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "lora_name": "mlp-rslora"}
        body = {"text_input": PROMPTS[1], "exclude_input_in_output": True, "sampling_parameters": json.dumps(sampling)}
        request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        answer = json.load(urllib.request.urlopen(request, timeout=120))["text_output"]  # HTTP: Triton's generate endpoint
        assert answer == expected[("mlp-rslora", PROMPTS[1])]
        results, error = stream_request(server, [tensor("text_input", PROMPTS[0], shape=[1, 1]),
                                                 tensor("max_tokens", 8, shape=[1, 1]), tensor("stream", True, shape=[1, 1]),
                                                 tensor("lora_task_id", 7, dtype="UINT64", shape=[1, 1])], model="ensemble")
        assert error is None and "".join(texts(results)) == expected[("7", PROMPTS[0])]
        _, error = stream_request(server, llm_inputs(PROMPTS[0], max_tokens=4, lora_name="nope"))
        assert error is not None and "'lora_name': unknown adapter 'nope'; this model serves" in str(error)
        check_lora_requests_info(server)

        port = free_port()
        command = [sys.executable, "-m", "pagedserve.client.cli", "openai", "--port", str(port), "--triton-url",
                   server.grpc_url, "--lora-module", "q-and-v", "--lora-module", "every-projection=llm"]
        gateway = ServerProcess(command, tmp_path / "gateway.log", name="pagedserve openai").start()
        try:
            gateway.wait_ready(lambda: http_status(f"http://localhost:{port}/health") == 200, time.monotonic() + 60)
            client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="none", max_retries=0)
            assert sorted(m.id for m in client.models.list()) == ["every-projection", "llm", "q-and-v"]
            for name in ("q-and-v", "every-projection"):
                done = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                                 extra_body={"ignore_eos": True})
                assert done.model == name and done.choices[0].text == expected[(name, PROMPTS[0])]
        finally:
            gateway.stop()


def lora_requests_info(server) -> list[tuple[dict[str, str], float]]:
    """Each `vllm:lora_requests_info` series on the metrics port: its labels and value."""
    body = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return [(dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value))
            for labels, value in re.findall(r"^vllm:lora_requests_info\{([^}]*)\} (\S+)$", body, re.M)]


def newest_lora_requests_info(server) -> dict[str, str]:
    """The labels of the newest series (the highest time), which endpoint pickers read."""
    return max(lora_requests_info(server), key=lambda series: series[1])[0]


def check_lora_requests_info(server) -> None:
    """vLLM's LoRA gauge as endpoint pickers read it (the newest series): while an adapter's request
    runs it names that adapter among the running ones; once idle, none, with max_lora the engine's
    max_loras."""
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream_request, server, llm_inputs(PROMPTS[1], max_tokens=400, temperature=0,
                                                                 ignore_eos=True, lora_name="q-and-v"))
        seen: list[str] = []
        while not running.done():
            seen.append(newest_lora_requests_info(server)["running_lora_adapters"])
            time.sleep(0.05)
        assert running.result()[1] is None
    assert "q-and-v" in seen
    wait_idle(server)
    time.sleep(0.5)  # a refresh after the request left
    newest = newest_lora_requests_info(server)
    assert newest["running_lora_adapters"] == newest["waiting_lora_adapters"] == ""
    assert newest["max_lora"] == "4"
