"""Two pagedserve replicas behind vLLM's router, a multi-turn chat workload, side by side in one run:
one replica alone (the hit rate to match), then the router with `round_robin`, `cache_aware` (placing by
the prompts it routed) and `kv_aware` (placing by the KV-cache events each replica publishes).

    python benchmarks/peers/vllm_router.py --setup     # once: the router in its own venv
    python benchmarks/replicas.py [--conversations 16] [--concurrency 8] [--max-tokens 24]

Each replica is a tritonserver with the bundled model (one CPU thread each: the two share the
machine's two cores) and the `pagedserve openai` gateway in front (the router's worker URL). A
conversation opens with a note of its own (about 460 tokens) and has 4-8 turns (seeded), each
resending the whole history, streamed; conversations run `--concurrency` at a time. Per row: the
prefix-cache hit rate (prompt tokens whose KV blocks were reused, from each replica's own
counters), TTFT p50 / p99 (to the first content chunk, at the client) and output tok/s. Each
row's conversations are its own (a tag in their first line), so no row reuses another's blocks.
Last, the death case: replica a's
tritonserver killed with requests in flight through the router, and what the clients saw.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.peers import vllm_router
from benchmarks.soak import read_metrics
from benchmarks.workload import machine
from pagedserve.client.process import ServerProcess, free_port, http_status
from pagedserve.client.repository import write_repository
from pagedserve.client.triton_server import TritonServer

ENGINE_BLOCK_SIZE = "16"
"""The engine's default block_size: what the router's KV index must be told."""
ENGINE = {"dtype": "float32", "max_num_seqs": "16", "max_model_len": "2048", "kv_cache_bytes": str(512 * 1024**2),
          "num_threads": "1"}
"""One core each: two replicas share this machine's two cores (two threads each would fight over them)."""
QUERIES, HITS = "pagedserve:prefix_cache_queries_total", "pagedserve:prefix_cache_hits_total"
TOPICS = ["rivers", "bridges", "printing presses", "lighthouses", "gardens", "trains", "clocks", "maps"]
PLACES = ["Venice", "Antwerp", "Lyon", "Bruges", "Porto", "Krakow", "Ghent", "Turin"]
STATES = ["rebuilt", "moved", "sold", "painted", "flooded", "restored", "enlarged", "closed"]
NOTE_SENTENCES = 30
"""Each conversation opens with a note of its own (about 460 tokens) that every turn resends: the
history whose KV blocks a replica can reuse."""


@dataclass
class Replica:
    """One replica: its tritonserver (fixed ports, so it can come back where it was) and its gateway."""

    name: str
    triton: TritonServer
    gateway: ServerProcess
    url: str
    kv_events: str
    """Where its engine publishes its KV-cache events (tcp://127.0.0.1:PORT)."""

    def counter(self, name: str) -> float:
        return read_metrics(self.triton.metrics_url, (name,))[name] or 0.0

    def stop(self) -> None:
        self.gateway.stop()
        self.triton.cleanup()


def start_replica(workdir: Path, name: str, engine: dict[str, str] | None = None) -> Replica:
    """A tritonserver with the `llm` model (the bundled model unless `engine` names one), publishing
    its KV-cache events on a port of its own, and its gateway."""
    kv_events = f"tcp://127.0.0.1:{free_port()}"
    repository = write_repository(workdir / name / "repo",
                                  engine={**(engine or ENGINE), "kv_events_config": f"endpoint={kv_events}"})
    triton = TritonServer(repository, log_file=workdir / name / "tritonserver.log", models=["llm"],
                          http_port=free_port(), grpc_port=free_port(), metrics_port=free_port()).start(timeout=300)
    port = free_port()
    command = [sys.executable, "-m", "pagedserve.client.cli", "openai", "--port", str(port), "--triton-url",
               triton.grpc_url, "--triton-metrics-url", f"localhost:{triton.metrics_port}"]
    gateway = ServerProcess(command, workdir / name / "gateway.log", name=f"pagedserve openai ({name})").start()
    url = f"http://127.0.0.1:{port}"
    # ready for a router: Triton serves, and the gateway's tokenizer renders (routers render every request first)
    gateway.wait_ready(lambda: http_status(f"{url}/health") == 200 and renders(url), time.monotonic() + 120)
    return Replica(name, triton, gateway, url, kv_events)


def router_arguments(replicas: list[Replica], policy: str) -> list[str]:
    """What `policy` needs beyond the worker URLs: kv_aware subscribes to each replica's events."""
    if policy != "kv_aware":
        return []
    sources = [arg for r in replicas for arg in ("--kv-event-source", f"{r.url}={r.kv_events}")]
    return [*sources, "--kv-event-block-size", ENGINE_BLOCK_SIZE, "--kv-event-model", "llm"]


def renders(url: str) -> bool:
    body = json.dumps({"model": "llm", "prompt": "hello"}).encode()
    request = urllib.request.Request(f"{url}/v1/completions/render", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status == 200
    except OSError:
        return False


def conversations(count: int, tag: str, seed: int = 0) -> list[list[str]]:
    """Each conversation's system line (with its note), then its user turns (4-8), seeded; `tag`
    makes the row's prompts its own, and each conversation's system line is its own (no prefix
    shared beyond the chat template's first tokens)."""
    rng = random.Random(seed)
    chats = []
    for index in range(count):
        topic = TOPICS[index % len(TOPICS)]
        note = " ".join(f"The {rng.choice(TOPICS)} of {rng.choice(PLACES)} was {rng.choice(STATES)} in {1800 + rng.randrange(200)}."
                        for _ in range(NOTE_SENTENCES))
        turns = [f"[{tag} {index}] You are a concise assistant. Answer from this note.\n\n{note}",
                 f"Tell me something about {topic}."]
        turns += [f"And what about {rng.choice(TOPICS)} compared with {topic}? Keep it short."
                  for _ in range(rng.randint(3, 7))]
        chats.append(turns)
    return chats


def run_row(base_url: str, chats: list[list[str]], concurrency: int, max_tokens: int) -> dict[str, float]:
    """Every conversation through `base_url` (turns in order, conversations `concurrency` at a time):
    TTFT p50 / p99 and output tok/s."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
    ttfts: list[float] = []
    tokens = 0

    def converse(turns: list[str]) -> tuple[list[float], int]:
        history = [{"role": "system", "content": turns[0]}]
        firsts, produced = [], 0
        for turn in turns[1:]:
            history.append({"role": "user", "content": turn})
            start, first, text = time.perf_counter(), None, ""
            stream = client.chat.completions.create(model="llm", messages=history, max_tokens=max_tokens, temperature=0,
                                                    stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    produced += chunk.usage.completion_tokens
            firsts.append((first or time.perf_counter()) - start)
            history.append({"role": "assistant", "content": text})
        return firsts, produced

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        for firsts, produced in pool.map(converse, chats):
            ttfts += firsts
            tokens += produced
    seconds = time.perf_counter() - start
    ttfts.sort()
    return {"requests": len(ttfts), "ttft_p50": statistics.median(ttfts),
            "ttft_p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))], "tok_s": tokens / seconds}


@dataclass
class KillCounts:
    """What the clients saw when a replica's tritonserver was killed with requests in flight."""

    sent: int
    completed: int
    failed: int
    """Ended with an error the client saw (a stream cut mid-way, a request the router could not place)."""
    hung: int
    """Neither, `wait_s` after the kill: must be 0."""
    after_sent: int
    after_completed: int
    """Requests sent one by one after the kill, and those that succeeded."""


def kill_in_flight(client: Any, dead: Replica, sent: int = 8, after: int = 6, wait_s: float = 150.0) -> KillCounts:
    """`sent` chats at once through the router (`client`), `dead`'s tritonserver killed with SIGKILL
    half a second in; then `after` chats one by one."""
    import openai

    def ask(index: int) -> str:
        reply = client.chat.completions.create(
            model="llm", max_tokens=24, temperature=0,
            messages=[{"role": "user", "content": f"Request {index}: write one sentence about rivers."}])
        return reply.choices[0].message.content or ""

    with concurrent.futures.ThreadPoolExecutor(sent) as pool:
        in_flight = [pool.submit(ask, i) for i in range(sent)]
        time.sleep(0.5)
        dead.triton.kill()
        done, hung = concurrent.futures.wait(in_flight, timeout=wait_s)
    errors = [f.exception() for f in done if f.exception() is not None]
    unexpected = [e for e in errors if not isinstance(e, openai.APIError)]
    if unexpected:
        raise unexpected[0]
    completed_after = 0
    for index in range(after):
        try:
            completed_after += bool(ask(100 + index))
        except openai.APIError:
            pass
    return KillCounts(sent, len(done) - len(errors), len(errors), len(hung), after, completed_after)


def hit_rates(replicas: list[Replica], before: dict[str, list[float]]) -> tuple[list[float | None], float]:
    """Each replica's hit rate since `before` (None: it served nothing), and all replicas' together."""
    queries = [r.counter(QUERIES) - q for r, q in zip(replicas, before[QUERIES])]
    hits = [r.counter(HITS) - h for r, h in zip(replicas, before[HITS])]
    each = [h / q if q else None for h, q in zip(hits, queries)]
    return each, sum(hits) / sum(queries) if sum(queries) else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--policies", default="round_robin,cache_aware,kv_aware")
    args = parser.parse_args()
    vllm_router.setup()
    workdir = Path(tempfile.mkdtemp(prefix="pagedserve-replicas-"))
    replicas: list[Replica] = []
    try:
        for name in ("a", "b"):
            print(f">> starting replica {name}", file=sys.stderr, flush=True)
            replicas.append(start_replica(workdir, name))
        print(machine())
        print(f"2 replicas (bundled model, float32, 1 thread each), vllm-router {vllm_router.VERSION}; {args.conversations} conversations "
              f"of 4-8 turns, {args.concurrency} at a time, {args.max_tokens} tokens a turn, greedy, streamed\n")
        print("| routing | requests | hit rate a | hit rate b | hit rate | TTFT p50 ms | TTFT p99 ms | output tok/s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        rows = [("one replica alone", None)] + [(policy, policy) for policy in args.policies.split(",")]
        for label, policy in rows:
            before = {name: [r.counter(name) for r in replicas] for name in (QUERIES, HITS)}
            chats = conversations(args.conversations, tag=label)
            router = None
            if policy is None:
                url = replicas[0].url
            else:
                port = free_port()
                router = vllm_router.start([r.url for r in replicas], port, workdir / f"router-{policy}.log", policy=policy,
                                           extra=router_arguments(replicas, policy))
                url = f"http://127.0.0.1:{port}"
            try:
                row = run_row(url, chats, args.concurrency, args.max_tokens)
            finally:
                if router is not None:
                    router.stop()
            each, together = hit_rates(replicas, before)
            shown = [f"{rate:.0%}" if rate is not None else "-" for rate in each]
            print(f"| {label} | {row['requests']} | {shown[0]} | {shown[1]} | {together:.0%} | {row['ttft_p50'] * 1e3:.0f} "
                  f"| {row['ttft_p99'] * 1e3:.0f} | {row['tok_s']:.1f} |", flush=True)
        port = free_port()
        router = vllm_router.start([r.url for r in replicas], port, workdir / "router-kill.log", policy="round_robin")
        try:
            import openai

            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
            counts = kill_in_flight(client, replicas[0])
        finally:
            router.stop()
        print(f"\nReplica a's tritonserver killed (SIGKILL) with {counts.sent} chats in flight through the router "
              f"(round_robin): {counts.completed} completed, {counts.failed} failed with an error the client saw, "
              f"{counts.hung} hung; then {counts.after_completed} of {counts.after_sent} sent one by one succeeded.")
    finally:
        for replica in replicas:
            if replica.triton.is_running() or replica.gateway.is_running():
                replica.stop()


if __name__ == "__main__":
    main()
