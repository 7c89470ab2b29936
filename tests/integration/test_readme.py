"""The README's "Use it" section as a newcomer runs it: every code block in it, against a real
tritonserver (and `pagedserve openai` in front of it), each with a check that its output makes
sense (the capital question answers Paris). A block added to the section without a check here
fails, so the README cannot drift from what the server does."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import gateway_process

README = Path(__file__).resolve().parents[2] / "README.md"
PAGEDSERVE = str(Path(sys.executable).with_name("pagedserve"))
QUESTION = "Name the capital of France.\n\n"
"""What `pagedserve chat` is typed: one question, then the empty line that ends the chat."""


def use_it_blocks() -> list[tuple[str, str]]:
    """(language, text) of each fenced block from "## Use it" up to the next `## ` heading."""
    text = README.read_text()
    section = text[text.index("\n## Use it\n"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)


def commands(script: str) -> list[str]:
    """A bash block's commands: lines joined across trailing backslashes, comments dropped."""
    joined = re.sub(r"\\\n\s*", "", script)
    return [line for line in (raw.split("  #")[0].strip() for raw in joined.splitlines()) if line]


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z']+", text)


def answers_paris(output: str) -> None:
    assert "Paris" in output, output


def writes_prose(output: str) -> None:
    """A sampled reply: several words, mostly letters (not an empty string or token soup)."""
    found = words(output)
    assert len(found) >= 5 and sum(map(len, found)) >= 0.6 * len(output.strip()), output


def streams_prose(output: str) -> None:
    """Server-sent events whose text_output pieces, joined, read as prose."""
    pieces = [json.loads(line[len("data: "):]) for line in output.splitlines() if line.startswith("data: ")]
    assert pieces, output
    writes_prose("".join(piece["text_output"] for piece in pieces))


def generate_answers_paris(output: str) -> None:
    answers_paris(json.loads(output)["text_output"])


def chat_completion_answers_paris(output: str) -> None:
    answers_paris(json.loads(output)["choices"][0]["message"]["content"])


CHECKS = {
    "pagedserve generate": answers_paris,
    "pagedserve chat": answers_paris,
    "LLMClient(": writes_prose,
    "grpc.InferenceServerClient(": answers_paris,
    "/generate_stream": streams_prose,
    "/generate ": generate_answers_paris,
    "LLMEngine(": answers_paris,
    "/v1/chat/completions": chat_completion_answers_paris,
    "OpenAI(": answers_paris,
}
"""What each command or block must print, by a phrase that names it; the first phrase it holds."""


def check_for(text: str):
    for phrase, check in CHECKS.items():
        if phrase in text:
            return check
    raise AssertionError(f"the README runs {text!r}, which tests/integration/test_readme.py has no check for: add one")


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    """`pagedserve openai` as the README's block starts it, on a free port in front of the test server."""
    line = next(c for _, block in use_it_blocks() for c in commands(block) if "pagedserve openai" in c)
    command = [PAGEDSERVE if word.endswith("pagedserve") else word for word in line.split()]
    log = tmp_path_factory.mktemp("readme_gateway") / "gateway.log"
    with gateway_process([*command, "--triton-url", server.grpc_url], log) as url:
        yield url.removeprefix("http://")


def on_test_servers(text: str, server, gateway: str | None) -> str:
    """The README's text with its default ports (8001 gRPC, 8000 HTTP, 9000 the gateway) and the
    `pagedserve` command pointed at the servers and the venv of this run (its client commands
    default to localhost:8001: they get `--url`)."""
    text = text.replace("localhost:8001", server.grpc_url).replace("localhost:8000", server.http_url)
    if gateway is not None:
        text = text.replace("localhost:9000", gateway)
    if re.match(r"pagedserve (generate|chat)\b", text) and "--url" not in text:
        text += f" --url {server.grpc_url}"
    return re.sub(r"(?<![\w/.-])(?:\.venv/bin/)?pagedserve(?= )", PAGEDSERVE, text)


def run(args: list[str], stdin: str | None = None) -> str:
    done = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_use_it_has_the_blocks_this_test_knows():
    """Every block of the section is run below: the shell ones command by command, the Python ones whole."""
    blocks = use_it_blocks()
    assert {language for language, _ in blocks} == {"bash", "python"}
    for language, text in blocks:
        for item in commands(text) if language == "bash" else [text]:
            if "pagedserve openai" not in item:
                check_for(item)


@pytest.mark.parametrize("index", range(len(use_it_blocks())))
def test_readme_block_gives_a_sensible_answer(index, server, request):
    """The block, run as a user would after `make serve`, prints what a user expects of it."""
    language, text = use_it_blocks()[index]
    gateway = request.getfixturevalue("gateway") if "localhost:9000" in text else None
    if language == "python":
        check_for(text)(run([sys.executable, "-c", on_test_servers(text, server, gateway)]))
        return
    for command in commands(text):
        if "pagedserve openai" in command:
            continue  # the gateway fixture runs this line
        stdin = QUESTION if "pagedserve chat" in command else None
        check_for(command)(run(["bash", "-c", on_test_servers(command, server, gateway)], stdin))
