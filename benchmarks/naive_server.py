"""The naive baseline people start with: Hugging Face transformers `generate` behind a
small HTTP server, one request at a time, tokens streamed back as server-sent events.

It exists so benchmarks/serving.py can put pagedserve next to what it replaces, driven
by the same load generator over the same wire format. Same model (the bundled
SmolLM2-135M-Instruct GGUF unless --model), same tokenizer, chosen dtype.

Endpoint (the subset of Triton's `generate_stream` that client/loadgen/transports.py's
HttpTransport sends, so `pagedserve bench --protocol http --url localhost:PORT` drives it):

    POST /v2/models/<any name>/generate_stream      (or POST /generate_stream)
    {"text_input": "...",                            # or "prompt"
     "sampling_parameters": "{\"max_tokens\": 64, \"ignore_eos\": true, \"temperature\": 0}"}
                                                     # a JSON string (Triton) or an object
    -> text/event-stream, one event per generated token:
    data: {"text_output": " delta", "num_output_tokens": 1, "num_input_tokens": 12, "finish_reason": null}
    the last event has "finish_reason": "length" or "stop"; errors: data: {"error": "..."}

    GET /v2/health/ready -> 200 (the port opens only after the model is loaded)

Sampling parameters honoured: max_tokens (default 16), ignore_eos (-> min_new_tokens =
max_tokens), temperature (default 1.0; 0 = greedy), top_p, top_k, seed; others ignored.
Prompts are encoded like pagedserve's `text_input` (tokenizer defaults, no chat template).

    python benchmarks/naive_server.py --port 8100 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from pagedserve.backend.model_files import default_model_path
from pagedserve.backend.tokenizer import load_tokenizer

_STREAM_PATH = re.compile(r"^(/v2/models/[^/]+)?/generate_stream/?$")


class TokenStreamer(TextIteratorStreamer):
    """TextIteratorStreamer that yields (text delta, tokens) for every generated token.

    The stock streamer holds text back until a word ends, which would make the
    baseline's TTFT and ITL look worse than its generation really is, and it does not
    say how many tokens a piece of text carries. Only a split multi-byte character is
    held back here (until the next token completes it).
    """

    def __init__(self, tokenizer: Any, timeout: float | None = None):
        super().__init__(tokenizer, skip_prompt=True, timeout=timeout, skip_special_tokens=True)
        self.pending = 0

    def put(self, value: torch.Tensor) -> None:
        if value.dim() > 1:
            value = value[0]
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.token_cache.extend(value.tolist())
        self.pending += value.numel()
        self._flush(final=False)

    def end(self) -> None:
        self._flush(final=True)
        self.next_tokens_are_prompt = True
        self.text_queue.put(self.stop_signal, timeout=self.timeout)

    def _flush(self, final: bool) -> None:
        if not self.pending:
            return
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        if text.endswith("\ufffd") and not final:
            return
        delta, self.print_len = text[self.print_len :], len(text)
        self.text_queue.put((delta, self.pending), timeout=self.timeout)
        self.pending = 0


class _Cancelled(StoppingCriteria):
    """Stops generate() once the client has gone away."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class NaiveGenerator:
    """The model, its tokenizer and the lock that makes requests take turns."""

    def __init__(self, model_path: str, dtype: str):
        self.tokenizer = load_tokenizer(model_path)
        if model_path.endswith(".gguf"):
            directory, name = os.path.split(model_path)
            model = AutoModelForCausalLM.from_pretrained(directory or ".", gguf_file=name, dtype=getattr(torch, dtype))
        else:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model = model.eval()
        self.lock = threading.Lock()
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id

    def generation_kwargs(self, params: dict[str, Any]) -> dict[str, Any]:
        max_tokens = int(params.get("max_tokens", 16))
        if max_tokens < 1:
            raise ValueError(f"'max_tokens': must be >= 1, got {max_tokens}")
        temperature = float(params.get("temperature", 1.0))
        kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "pad_token_id": self.pad_token_id}
        if _truthy(params.get("ignore_eos", False)):
            kwargs["min_new_tokens"] = max_tokens
        elif params.get("min_tokens") is not None:
            kwargs["min_new_tokens"] = int(params["min_tokens"])
        if temperature > 0:
            kwargs |= {"do_sample": True, "temperature": temperature,
                       "top_p": float(params.get("top_p", 1.0)), "top_k": int(params.get("top_k", 0)) or None}
        else:
            kwargs |= {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return kwargs


def _truthy(value: Any) -> bool:
    return value in (True, 1) or str(value).lower() in ("true", "1")


def _sampling_parameters(body: dict[str, Any]) -> dict[str, Any]:
    raw = body.get("sampling_parameters", {})
    params = json.loads(raw) if isinstance(raw, str) else dict(raw or {})
    if not isinstance(params, dict):
        raise ValueError("'sampling_parameters': must be a JSON object")
    for key in ("max_tokens", "ignore_eos", "temperature", "top_p", "top_k", "seed", "min_tokens"):
        if key in body and key not in params:  # top-level, TensorRT-LLM style
            params[key] = body[key]
    return params


def make_handler(generator: NaiveGenerator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        disable_nagle_algorithm = True  # small SSE writes must not wait for ACKs (ITL)
        protocol_version = "HTTP/1.0"  # the stream ends when the connection closes

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (quiet under load)
            pass

        def do_GET(self) -> None:
            if self.path.rstrip("/") in ("/v2/health/ready", "/v2/health/live", "/health"):
                self._reply(200, {"ready": True})
            else:
                self._reply(404, {"error": f"no such path {self.path}"})

        def do_POST(self) -> None:
            if not _STREAM_PATH.match(self.path):
                self._reply(404, {"error": f"POST /v2/models/<name>/generate_stream, not {self.path}"})
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                prompt = body.get("text_input", body.get("prompt"))
                if not isinstance(prompt, str):
                    raise ValueError("'text_input': a string is required")
                params = _sampling_parameters(body)
                kwargs = generator.generation_kwargs(params)
            except (ValueError, TypeError) as exc:
                self._reply(400, {"error": str(exc)})
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            with generator.lock:  # the naive part: one request at a time, the rest queue here
                self._generate(prompt, params, kwargs)

        def _generate(self, prompt: str, params: dict[str, Any], kwargs: dict[str, Any]) -> None:
            ids = generator.tokenizer(prompt, return_tensors="pt")
            num_input = int(ids["input_ids"].shape[1])
            streamer = TokenStreamer(generator.tokenizer)
            cancel = threading.Event()
            failure: list[BaseException] = []

            def run() -> None:
                try:
                    if params.get("seed") is not None:
                        torch.manual_seed(int(params["seed"]))
                    with torch.inference_mode():
                        generator.model.generate(**ids, streamer=streamer,
                                                 stopping_criteria=StoppingCriteriaList([_Cancelled(cancel)]), **kwargs)
                except BaseException as exc:  # noqa: BLE001 (reported to the client)
                    failure.append(exc)
                    streamer.text_queue.put(streamer.stop_signal)

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            produced, pending = 0, None
            try:
                for delta, count in streamer:
                    # One event behind, so the last one can carry the finish reason.
                    if pending is not None:
                        self._event(pending)
                    produced += count
                    pending = {"text_output": delta, "num_output_tokens": count, "num_input_tokens": num_input,
                               "finish_reason": None}
                thread.join()
                if failure:
                    self._event({"error": f"{type(failure[0]).__name__}: {failure[0]}"})
                    return
                if pending is not None:
                    pending["finish_reason"] = "length" if produced >= kwargs["max_new_tokens"] else "stop"
                    self._event(pending)
            except (BrokenPipeError, ConnectionResetError):
                cancel.set()  # the client left: stop generating, free the model for the next one
                for _ in streamer:
                    pass
                thread.join()

        def _event(self, payload: dict[str, Any]) -> None:
            self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


class NaiveServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # a burst of concurrent clients must not overflow the listen backlog


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", default="", help="HF directory or .gguf (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    generator = NaiveGenerator(args.model or default_model_path(), args.dtype)
    with torch.inference_mode():  # first call pays one-time costs, not the first client
        generator.model.generate(**generator.tokenizer("warm up", return_tensors="pt"), max_new_tokens=2,
                                 do_sample=False, pad_token_id=generator.pad_token_id)
    server = NaiveServer((args.host, args.port), make_handler(generator))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop cleanly on SIGTERM too
    print(f"naive server ready on http://{args.host}:{server.server_port} "
          f"({args.dtype}, {torch.get_num_threads()} threads, loaded in {time.perf_counter() - started:.1f} s)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
