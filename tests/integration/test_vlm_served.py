"""Images through a real tritonserver, as Triton's vLLM-backend users send them: `llm`'s `image`
input (BYTES, one base64-encoded image file per element) beside `text_input` holding a placeholder
per image, over gRPC streaming and HTTP's generate endpoint; and as OpenAI clients send them, an
image_url part (a data: URL) through `pagedserve openai` with the openai SDK, streamed and not (and
its render route, as a router asks, gives the offline engine's prompt ids). Each
gives the offline engine's greedy text for a tiny random LLaVA, with one image and with two. Bad
images (not base64, not an image, truncated, over the pixel cap by its header, too many, too few
placeholders) are refused by field while a bystander stream keeps its tokens, and the server serves
on with no KV block held."""

from __future__ import annotations

import base64
import json
import sys
import time
import urllib.request

import openai

from pagedserve.backend import LLMEngine, SamplingParams
from pagedserve.client.process import ServerProcess, free_port, http_status
from pagedserve.client.repository import write_repository
from pagedserve.client.triton_server import TritonServer

from benchmarks.fuzz import Bystander, bystander_text, png_claiming

from ..vlm_checks import pictures, png_bytes, write_tiny_llava
from .conftest import llm_inputs, metric, stream_request, tensor, texts, wait_idle

ONE = "Describe the picture: <image> What is in it?"
TWO = "Compare <image> with <image> and tell the difference between them."
SAMPLING = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}


def image_tensor(files: list[bytes]):
    return tensor("image", [base64.b64encode(f).decode() for f in files])


def test_images_through_llm_equal_the_offline_engine(tmp_path):
    model = write_tiny_llava(tmp_path / "llava")
    files = [png_bytes(p) for p in pictures(3)]
    offline = LLMEngine(model=model, dtype="float32")
    params = SamplingParams(**SAMPLING)
    expected = [c.text for c in offline.generate([{"prompt": ONE, "multi_modal_data": {"image": files[0]}},
                                                  {"prompt": TWO, "multi_modal_data": {"image": files[1:]}}],
                                                 params, use_tqdm=False)]
    assert expected[0] != expected[1]
    repository = write_repository(tmp_path / "repo", model=model, engine={"dtype": "float32"})
    with TritonServer(repository, log_file=tmp_path / "server.log", models=["llm"]).start(timeout=300) as server:
        for prompt, images, text in ((ONE, files[:1], expected[0]), (TWO, files[1:], expected[1])):
            results, error = stream_request(server, [*llm_inputs(prompt, **SAMPLING), image_tensor(images)])
            assert error is None and "".join(texts(results)) == text
        body = {"text_input": ONE, "image": [base64.b64encode(files[0]).decode()], "exclude_input_in_output": True,
                "sampling_parameters": json.dumps(SAMPLING)}
        request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        assert json.load(urllib.request.urlopen(request, timeout=120))["text_output"] == expected[0]

        check_bad_images_harm_no_bystander(server, files)
        results, error = stream_request(server, [*llm_inputs(ONE, **SAMPLING), image_tensor(files[:1])])
        assert error is None and "".join(texts(results)) == expected[0]  # the server serves on
        check_openai_chat(server, offline, files[0], tmp_path)


def check_bad_images_harm_no_bystander(server, files: list[bytes]) -> None:
    """Each kind of bad image gets an error naming its field while a greedy text stream runs beside
    them with the tokens it gets alone; no KV block is held after."""
    cases = [([b"not an image"], ONE, "'image': is not an image Pillow can read"),
             ([files[0][: len(files[0]) // 2]], ONE, "'image': could not be decoded"),  # truncated
             ([png_claiming(100_000, 100_000)], ONE, "'image': is over the engine's max_image_pixels"),
             ([png_claiming(5_000, 5_000)], ONE, "'image': is 5000x5000 = 25000000 pixels; the limit is 16777216"),
             (files[:1] * 9, ONE + " <image>" * 8, "'image': 9 images; the limit is 8"),
             (files[:1], TWO, "'prompt': has 2 image placeholders (<image>) for 1 images")]
    bystander = Bystander(server.grpc_url, bystander_text(server.grpc_url))
    bystander.start()
    try:
        for images, prompt, message in cases:
            _, error = stream_request(server, [*llm_inputs(prompt, **SAMPLING), image_tensor(images)])
            assert error is not None and message in str(error), (message, error)
        _, error = stream_request(server, [*llm_inputs(ONE, **SAMPLING), tensor("image", ["this is not base64!"])])
        assert error is not None and "'image': element 0 is not base64" in str(error)
    finally:
        bystander.stop()
    assert bystander.runs >= 1 and not bystander.errors and not bystander.mismatches
    wait_idle(server)
    assert metric(server, "pagedserve:kv_blocks_used") == 0


def check_openai_chat(server, offline: LLMEngine, picture: bytes, tmp_path) -> None:
    """An image_url part through the gateway: the chat template's placeholder, the image in order."""
    data_url = "data:image/png;base64," + base64.b64encode(picture).decode()
    parts = [{"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": data_url}}]
    offline_parts = [{"type": "text", "text": "What is in"}, {"type": "image"}]
    [completion] = offline.generate([{"messages": [{"role": "user", "content": offline_parts}],
                                      "multi_modal_data": {"image": picture}}], SamplingParams(**SAMPLING), use_tqdm=False)
    port = free_port()
    command = [sys.executable, "-m", "pagedserve.client.cli", "openai", "--port", str(port), "--triton-url", server.grpc_url]
    gateway = ServerProcess(command, tmp_path / "gateway.log", name="pagedserve openai").start()
    try:
        gateway.wait_ready(lambda: http_status(f"http://localhost:{port}/health") == 200, time.monotonic() + 60)
        client = openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="none", max_retries=0)
        card = json.load(urllib.request.urlopen(f"http://localhost:{port}/v1/models", timeout=30))["data"][0]
        assert card["input_modalities"] == ["text", "image"]
        ask = dict(model="llm", messages=[{"role": "user", "content": parts}], max_tokens=10, temperature=0,
                   extra_body={"ignore_eos": True})
        assert client.chat.completions.create(**ask).choices[0].message.content == completion.text
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(**ask, stream=True)
                           if chunk.choices)
        assert streamed == completion.text
        ids, mm = offline.prompt_inputs({"messages": [{"role": "user", "content": offline_parts}],
                                         "multi_modal_data": {"image": picture}})
        render = urllib.request.Request(f"http://localhost:{port}/v1/chat/completions/render", headers={
            "Content-Type": "application/json"}, data=json.dumps({"model": "llm", "messages": ask["messages"]}).encode())
        rendered = json.load(urllib.request.urlopen(render, timeout=60))  # what a router asks: the engine's ids
        assert rendered["token_ids"] == ids and rendered["features"]["mm_hashes"]["image"] == [mm.images[0].content_hash.hex()]
        refused = {**ask, "messages": [{"role": "user", "content": [{"type": "image_url",
                                                                       "image_url": {"url": "http://169.254.169.254/x"}}]}]}
        try:
            client.chat.completions.create(**refused)
            raise AssertionError("an image URL from a host nobody allowed was fetched")
        except openai.BadRequestError as error:
            assert "fetches no image URLs" in str(error) and error.body["param"] == "messages[0].content[0].image_url.url"
    finally:
        gateway.stop()
