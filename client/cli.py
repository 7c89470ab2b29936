"""`pagedserve` command line: serve, openai, generate, chat, bench, tokenizer, build-kernels."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving on NVIDIA Triton Inference Server")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start a local tritonserver with the model repository")
    serve.add_argument("--model", default="",
                       help="Hugging Face model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=8001)
    serve.add_argument("--metrics-port", type=int, default=8002)
    serve.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="engine parameter, e.g. --set dtype=bfloat16 (repeatable)")
    serve.add_argument("--repository-dir", default="", help="where to write the runtime model repository (default: a temp dir)")
    serve.add_argument("--exit-timeout-secs", type=int, default=5,
                       help="on Ctrl-C, how long Triton lets requests in flight finish before it exits (Triton's default: 30)")
    serve.set_defaults(run=run_serve)

    for name, helptext in (("generate", "generate text for one prompt"), ("chat", "interactive chat, streaming")):
        command = commands.add_parser(name, help=helptext)
        if name == "generate":
            command.add_argument("prompt")
            command.add_argument("--stream", action="store_true", help="print tokens as they arrive")
            command.add_argument("--chat-template", action="store_true", help="wrap the prompt as a user chat message")
        else:
            command.add_argument("--system", default=None, help="system prompt")
        command.add_argument("--url", default="localhost:8001", help="gRPC endpoint")
        command.add_argument("--model-name", default="llm")
        command.add_argument("--max-tokens", type=int, default=256)
        command.add_argument("--temperature", type=float, default=None,
                             help="default: the served model's recommended (the bundled model's card: 0.2)")
        command.add_argument("--top-p", type=float, default=None,
                             help="default: the served model's recommended (the bundled model's card: 0.9)")
        command.add_argument("--top-k", type=int, default=None)
        command.add_argument("--seed", type=int, default=None)
        command.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
        command.set_defaults(run=run_generate if name == "generate" else run_chat)

    openai = commands.add_parser(
        "openai", help="OpenAI-compatible HTTP API in front of a running tritonserver",
        description="OpenAI-compatible HTTP API in front of a running tritonserver. It listens on 127.0.0.1 "
                    "unless told otherwise; any other address needs an API key ($PAGEDSERVE_API_KEY, or a file: "
                    "--api-key-file / $PAGEDSERVE_API_KEY_FILE) or --allow-unauthenticated.")
    add_openai_arguments(openai)
    openai.set_defaults(run=run_openai)

    from .bench import add_bench_arguments  # imported here: keeps start-up light

    bench = commands.add_parser("bench", help="load-generate against a running server")
    add_bench_arguments(bench)

    tokenizer = commands.add_parser(
        "tokenizer", help="print a Hugging Face tokenizer directory for the model (genai-perf --tokenizer)")
    tokenizer.add_argument("--model", default="", help="model directory or .gguf file (default: the bundled one)")
    tokenizer.set_defaults(run=run_tokenizer)

    kernels = commands.add_parser("build-kernels", help="compile the CPU kernels (C) for this machine now "
                                                         "(make install runs it; an engine builds any missing at load)")
    kernels.set_defaults(run=run_build_kernels)

    args = parser.parse_args(argv)
    return args.run(args) or 0


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop,
    }


def add_openai_arguments(openai: argparse.ArgumentParser) -> None:
    """`pagedserve openai`'s flags: GatewayConfig's fields (its defaults, shown here)."""
    from .openai_gateway.config import (  # light: no server imports
        API_KEY_ENV,
        API_KEY_FILE_ENV,
        FLAGS,
        GENERATION_CONFIGS,
        GatewayConfig,
    )
    from .openai_gateway.reasoning_parsers import REASONING_PARSERS
    from .openai_gateway.tool_parsers import PARSERS

    defaults = GatewayConfig.__dataclass_fields__

    def default(name: str) -> Any:
        return defaults[name].default

    openai.add_argument("--host", default=default("host"),
                        help="address to listen on (default: %(default)s, this machine only; another address needs "
                             "an API key or --allow-unauthenticated)")
    openai.add_argument("--port", type=int, default=default("port"), help="(default: %(default)s)")
    openai.add_argument("--triton-url", default=default("triton_url"),
                        help="gRPC endpoint of tritonserver (default: %(default)s)")
    openai.add_argument("--model", action="append", default=None, dest="models",
                        help="Triton model to offer (repeatable; default: llm)")
    openai.add_argument("--served-model-name", default=None, help="OpenAI model id of the one model (default: its Triton name)")
    openai.add_argument("--tokenizer", default=None, help="the model's tokenizer (GGUF file or Hugging Face directory) for "
                                                          "the render and tokenize routes a router asks (default: the "
                                                          "Triton model's `model` parameter)")
    openai.add_argument("--triton-metrics-url", default=None, metavar="HOST:PORT",
                        help="the Triton server's metrics, passed through on /metrics (default: --triton-url's host, 8002)")
    openai.add_argument("--lora-module", action="append", default=[], dest="lora_modules", metavar="NAME[=MODEL]",
                        help="a LoRA adapter the server's multi_lora.json lists, offered as an OpenAI model of its own "
                             "(repeatable; MODEL: the model that serves it, default the first)")
    key = openai.add_argument_group("API key", f"Every /v1 route needs `Authorization: Bearer KEY` when a key is set. "
                                                f"Default: ${API_KEY_ENV}, else the file ${API_KEY_FILE_ENV} names.")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="file holding the key (e.g. a mounted Secret; a trailing newline is ignored)")
    key.add_argument("--api-key", default=None, metavar="KEY",
                     help=f"the key itself; visible to every user of the machine (ps, /proc): prefer ${API_KEY_ENV} "
                          "or --api-key-file")
    key.add_argument("--allow-unauthenticated", action="store_true",
                     help="serve a non-loopback --host without a key (anyone who reaches it can use the models)")
    openai.add_argument("--default-max-tokens", type=int, default=default("default_max_tokens"),
                        help="max_tokens of a request that gives none (default: %(default)s)")
    openai.add_argument(FLAGS["tool_call_parser"], dest="tool_call_parser", default=default("tool_call_parser"),
                        choices=PARSERS, help="how tool_choice auto reads the model's tool calls: hermes (Hermes, "
                                              "Qwen), mistral, llama3_json, openai (gpt-oss's Harmony), or auto: each "
                                              "by its markers (default: %(default)s)")
    openai.add_argument(FLAGS["reasoning_parser"], dest="reasoning_parser", default=default("reasoning_parser"),
                        choices=REASONING_PARSERS, help="tell a reasoning model's reasoning from its answer (the "
                                                        "message's `reasoning`): deepseek_r1, qwen3 (<think> tags), "
                                                        "openai_gptoss (gpt-oss's Harmony channels) (default: none)")
    openai.add_argument(FLAGS["generation_config"], dest="generation_config", default=default("generation_config"),
                        choices=GENERATION_CONFIGS, help="sampling fields a request leaves out: auto, the served model's "
                                                       "generation_config.json; vllm, vLLM's defaults (default: %(default)s)")
    openai.add_argument(FLAGS["allowed_media_domains"], dest="allowed_media_domains", nargs="*",
                        default=[], metavar="HOST",
                        help="hosts (and subdomains) whose http(s) image URLs the gateway fetches; none by default: "
                             "images come as data: URLs")
    limits = openai.add_argument_group("limits", "What one request or connection may take; the errors past the "
                                                 "body, choices and time limits name their flag.")
    helps = {
        "max_body_bytes": (int, "largest request body, bytes (413 past it)"),
        "max_choices_per_request": (int, "most choices per request: prompts x n (400 past it)"),
        "max_connections": (int, "most open connections (and requests in flight); a request on one more gets 503"),
        "max_header_bytes": (int, "largest request line and headers, bytes (400 and closed past it)"),
        "header_timeout_s": (float, "seconds a client may take to send a request's headers (408 and closed)"),
        "body_timeout_s": (float, "seconds a client may take to send a request's body after its headers (408)"),
        "keep_alive_timeout_s": (float, "seconds an idle kept-alive connection stays open"),
        "request_timeout_s": (float, "deadline of one request to Triton, seconds: past it the request is "
                                     "cancelled and answered 504 (an error event when streamed)"),
        "max_image_bytes": (int, "largest image fetched from an allowed URL, bytes"),
        "image_fetch_timeout_s": (float, "seconds an image URL's file may take to arrive"),
    }
    for name, (kind, text) in helps.items():
        limits.add_argument(FLAGS[name], dest=name, type=kind, default=default(name),
                            metavar="S" if kind is float else "N", help=f"{text} (default: %(default)s)")


def run_openai(args: argparse.Namespace) -> int:
    from .openai_gateway.config import API_KEY_ENV, FLAGS, GatewayConfig, GatewayConfigError

    if args.api_key is not None:
        print(f"pagedserve openai: warning: --api-key puts the key where every user of this machine can read it "
              f"(ps, /proc/*/cmdline); set ${API_KEY_ENV} or use --api-key-file instead", file=sys.stderr, flush=True)
    try:
        config = GatewayConfig(
            host=args.host, port=args.port, triton_url=args.triton_url, models=args.models or ["llm"],
            served_model_name=args.served_model_name, tokenizer=args.tokenizer, triton_metrics_url=args.triton_metrics_url,
            lora_modules=args.lora_modules, api_key=args.api_key,
            api_key_file=args.api_key_file,
            allow_unauthenticated=args.allow_unauthenticated, default_max_tokens=args.default_max_tokens,
            **{name: getattr(args, name) for name in FLAGS},
        )
    except GatewayConfigError as error:
        print(f"pagedserve openai: {error}", file=sys.stderr)
        return 2
    from .openai_gateway import run_gateway

    run_gateway(config)
    return 0


def run_build_kernels(args: argparse.Namespace) -> int:
    from pagedserve.kernels.cache_dir import cache_root
    from pagedserve.kernels.dispatch import build_cpu_kernels

    started = time.perf_counter()
    built = build_cpu_kernels(report=lambda line: print(f"  {line}", flush=True))
    ready = sum(built.values())
    print(f"{ready} of {len(built)} CPU kernels ready in {cache_root() / 'kernels'} ({time.perf_counter() - started:.0f} s)")
    if ready < len(built):
        print("the rest run torch ops instead (slower): the warnings above name why (e.g. no C compiler: set CC "
              "or install gcc)", file=sys.stderr)
    return 0


def run_tokenizer(args: argparse.Namespace) -> int:
    from pagedserve.backend.tokenizer import tokenizer_dir

    print(tokenizer_dir(args.model))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from .repository import write_repository
    from .triton_server import TritonServer

    engine = dict(item.split("=", 1) for item in args.set)
    workdir = args.repository_dir or tempfile.mkdtemp(prefix="pagedserve-")
    repository = write_repository(os.path.join(workdir, "model_repository"), model=args.model, engine=engine)
    server = TritonServer(
        repository, http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
        log_file=os.path.join(workdir, "tritonserver.log"), exit_timeout_s=args.exit_timeout_secs,
    )
    print(f"starting tritonserver with {repository} (log: {server.log_file}) ...", flush=True)
    server.start(timeout=600)
    print(
        f"\npagedserve is ready.\n"
        f"  gRPC     {server.grpc_url}\n"
        f"  HTTP     http://{server.http_url}\n"
        f"  metrics  {server.metrics_url}\n\n"
        f"try:\n"
        f"  pagedserve generate \"Name the capital of France.\" --chat-template --stream\n"
        f"  curl -s -X POST http://{server.http_url}/v2/models/llm/generate "
        f"-d '{{\"text_input\": \"The capital of France is\", "
        f"\"sampling_parameters\": \"{{\\\"max_tokens\\\": 8, \\\"temperature\\\": 0}}\"}}'\n\n"
        f"Ctrl-C stops the server.",
        flush=True,
    )
    for stop_signal in (signal.SIGINT, signal.SIGTERM):  # also when started with SIGINT ignored (background jobs)
        signal.signal(stop_signal, signal.default_int_handler)
    try:
        while server.is_running():
            time.sleep(0.5)
        print("tritonserver exited unexpectedly:\n" + server.log_tail(40), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        print("\nstopping tritonserver ...", flush=True)
        server.stop()


def run_generate(args: argparse.Namespace) -> int:
    from .client import LLMClient

    client = LLMClient(args.url, args.model_name)
    if args.stream:
        for chunk in client.stream(args.prompt, chat_template=args.chat_template, **_sampling(args)):
            print(chunk.text, end="", flush=True)
        print()
    else:
        print(client.generate(args.prompt, chat_template=args.chat_template, **_sampling(args)))
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from .client import LLMClient

    client = LLMClient(args.url, args.model_name)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat with the model; an empty line or Ctrl-D ends it.")
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return 0
        if not line:
            return 0
        messages.append({"role": "user", "content": line})
        print("model> ", end="", flush=True)
        reply = ""
        for chunk in client.stream(messages=messages, **_sampling(args)):
            reply += chunk.text
            print(chunk.text, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    sys.exit(main())
