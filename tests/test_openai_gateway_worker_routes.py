"""The routes a router asks of a pagedserve replica (client/openai_gateway/worker_routes.py): a
request's prompt rendered as the engine's own token ids (vLLM's render routes and /tokenize, the
router's bodies with their extra fields accepted), the load in flight, and Triton's metrics passed
through; served for real in front of a fake Triton (tests/test_openai_gateway_limits.py's)."""

from __future__ import annotations

import base64
import http.server
import threading

import pytest

from pagedserve.backend.tokenizer import apply_chat_template, encode_prompt, load_tokenizer

from .test_openai_gateway_limits import KEY, FakeTriton, first_then_hang, serving, wait_for
from .vlm_checks import pictures, png_bytes, write_tiny_qwen25_vl

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a paged KV cache?"}]
ROUTER_CHAT_FIELDS = {"stream": False, "logprobs": False, "no_stop_trim": False, "ignore_eos": False,
                      "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
                      "stream_reasoning": True, "return_hidden_states": False, "include_reasoning": True}
"""What vLLM's router 0.1.17 adds to a chat body it forwards or renders."""


class ConfiguredTriton(FakeTriton):
    """A fake Triton whose `llm` configuration names the model (or cannot be read)."""

    def __init__(self, model: str | None, parameters: dict[str, str] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.model, self.parameters = model, parameters or {}

    async def model_parameters(self, name: str) -> dict[str, str]:
        if self.model is None:
            raise ConnectionError("failed to connect to all addresses")
        return {"model": self.model, "dtype": "float32", **self.parameters}


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(model_path)


def test_render_and_tokenize_give_the_engines_own_ids_from_the_served_models_tokenizer(model_path, tokenizer):
    chat_ids = apply_chat_template(tokenizer, MESSAGES)
    prompt_ids = encode_prompt(tokenizer, "Paged attention splits the KV cache")
    with serving(ConfiguredTriton(model_path)) as gateway:  # no --tokenizer: read from the model's configuration
        status, body, _ = gateway.post("/v1/chat/completions/render", {"model": "llm", "messages": MESSAGES,
                                                                      **ROUTER_CHAT_FIELDS})
        assert status == 200 and body == {"model": "llm", "token_ids": chat_ids}
        status, body, _ = gateway.post("/v1/completions/render", {"model": "llm", "prompt": "Paged attention splits "
                                       "the KV cache", "echo": False, "no_stop_trim": False, "return_hidden_states": False})
        assert status == 200 and body["token_ids"] == prompt_ids
        status, body, _ = gateway.post("/tokenize", {"model": "llm", "continue_final_message": False, "messages": MESSAGES})
        assert status == 200 and body["tokens"] == chat_ids and body["count"] == len(chat_ids)
        status, body, _ = gateway.post("/tokenize", {"prompt": "Paged attention splits the KV cache"})
        assert status == 200 and body["tokens"] == prompt_ids
        status, body, _ = gateway.post("/tokenize", {"prompt": "x", "add_special_tokens": False})
        assert status == 400 and body["error"]["param"] == "add_special_tokens"
        status, body, _ = gateway.post("/tokenize", {"messages": "hi"})
        assert status == 400 and body["error"]["param"] == "messages"
        status, body, _ = gateway.post("/v1/chat/completions/render", {"model": "nope", "messages": MESSAGES})
        assert status == 404 and body["error"]["param"] == "model"
        assert not gateway.triton.requests  # nothing was run


def image_part(picture) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png_bytes(picture)).decode()}}


def test_a_chat_with_images_renders_as_the_engine_expands_it_with_vllms_features(tmp_path, model_path):
    """Each image's placeholder expanded to its tokens (Qwen2.5-VL: as many as its size makes), and
    vLLM's `features`: where each image's tokens lie and its content hash, the hash the engine folds
    into those blocks' hashes and publishes in their KV events (`extra_keys`)."""
    from pagedserve.backend import LLMEngine

    qwen = write_tiny_qwen25_vl(tmp_path / "qwen")
    first, second = pictures(2)
    messages = [{"role": "user", "content": [image_part(first), {"type": "text", "text": "and"}, image_part(second),
                                             {"type": "text", "text": "differ how?"}]}]
    engine = LLMEngine(model=qwen, dtype="float32")
    ids, mm = engine.prompt_inputs({"messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "text", "text": "differ how?"}]}],
        "multi_modal_data": {"image": [png_bytes(first), png_bytes(second)]}})
    lengths = [image.length for image in mm.images]
    assert lengths[0] != lengths[1]  # the two sizes expand to different counts: the ids come from the processor
    features = {"mm_hashes": {"image": [image.content_hash.hex() for image in mm.images]},
                "mm_placeholders": {"image": [{"offset": image.offset, "length": image.length} for image in mm.images]}}
    with serving(ConfiguredTriton(qwen)) as gateway:
        status, body, _ = gateway.post("/v1/chat/completions/render", {"model": "llm", "messages": messages,
                                                                      **ROUTER_CHAT_FIELDS})
        assert status == 200 and body == {"model": "llm", "token_ids": ids, "features": features}
        status, body, _ = gateway.post("/tokenize", {"messages": messages})
        assert status == 200 and body["tokens"] == ids
        status, body, _ = gateway.post("/v1/chat/completions/render", {"model": "llm", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://169.254.169.254/x.png"}}]}]})
        assert status == 400 and body["error"]["param"] == "messages[0].content[0].image_url.url"  # never fetched
        not_a_picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"GIF89a?").decode()}}
        status, body, _ = gateway.post("/v1/chat/completions/render", {"model": "llm", "messages": [
            {"role": "user", "content": [not_a_picture]}]})
        assert status == 400 and body["error"]["param"] == "image" and "Pillow" in body["error"]["message"]
        assert not gateway.triton.requests
    with serving(ConfiguredTriton(qwen, {"limit_mm_per_prompt": "image=1"})) as gateway:  # the engine's own caps
        status, body, _ = gateway.post("/v1/chat/completions/render", {"model": "llm", "messages": messages})
        assert status == 400 and body["error"]["param"] == "image" and "limit_mm_per_prompt" in body["error"]["message"]
    with serving(ConfiguredTriton(model_path)) as gateway:  # a text model
        status, body, _ = gateway.post("/v1/chat/completions/render", {"model": "llm", "messages": messages})
        assert status == 400 and body["error"]["param"] == "image"


def test_the_tokenizer_flag_wins_and_an_unreadable_configuration_says_what_to_do(model_path, tokenizer):
    with serving(ConfiguredTriton(None), tokenizer=model_path) as gateway:
        status, body, _ = gateway.post("/tokenize", {"prompt": "hello"})
        assert status == 200 and body["tokens"] == encode_prompt(tokenizer, "hello")
    with serving(ConfiguredTriton(None)) as gateway:
        status, body, _ = gateway.post("/tokenize", {"prompt": "hello"})
        assert status == 503 and "--tokenizer" in body["error"]["message"]


def test_get_load_counts_the_generation_requests_in_flight():
    triton = FakeTriton(first_then_hang)
    with serving(triton) as gateway:
        assert gateway.call("GET", "/get_load")[1] == {"load": 0}
        connection = gateway.connection()
        connection.request("POST", "/v1/completions", body='{"model": "llm", "prompt": "hi", "stream": true}',
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.fp.readline()  # the first event is out: it runs
        assert gateway.call("GET", "/get_load")[1] == {"load": 1}
        connection.close()
        assert wait_for(lambda: gateway.call("GET", "/get_load")[1] == {"load": 0})


class MetricsPage(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        page = b'vllm:num_requests_waiting{model="llm",model_name="llm"} 3\n'
        self.send_response(200 if self.path == "/metrics" else 404)
        self.end_headers()
        self.wfile.write(page)

    def log_message(self, *args):
        pass


def test_metrics_pass_through_without_the_key_and_name_the_flag_when_triton_is_down():
    page = http.server.ThreadingHTTPServer(("127.0.0.1", 0), MetricsPage)
    threading.Thread(target=page.serve_forever, daemon=True).start()
    try:
        with serving(api_key=KEY, triton_metrics_url=f"127.0.0.1:{page.server_address[1]}") as gateway:
            status, text, response = gateway.call("GET", "/metrics")
            assert status == 200 and "vllm:num_requests_waiting" in text
            assert response.getheader("content-type").startswith("text/plain")
            assert gateway.call("GET", "/get_load")[0] == 200  # a router's poll needs no key either
            assert gateway.post("/tokenize", {"prompt": "hi"})[0] == 401  # but the prompt routes do
    finally:
        page.shutdown()
    with serving(triton_metrics_url="127.0.0.1:9") as gateway:
        status, body, _ = gateway.call("GET", "/metrics")
        assert status == 503 and "--triton-metrics-url" in body["error"]["message"]
