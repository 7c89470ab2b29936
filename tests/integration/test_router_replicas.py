"""Two pagedserve replicas (a tritonserver with the `pagedserve openai` gateway in front, each) behind
vLLM's router (`vllm-router`, in its own venv: benchmarks/peers/vllm_router.py, made on first use),
as a team past one replica runs them: under `cache_aware` and `kv_aware` (fed by each replica's
KV-cache events) every turn of a conversation lands on the replica that holds its history's KV
blocks; under `round_robin`, when one replica's
tritonserver is killed with requests in flight, no request hangs, requests sent after it all
succeed on the other, and the replica gets traffic again once it is back."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import openai
import pytest

from benchmarks.peers import vllm_router
from benchmarks.replicas import HITS, QUERIES, Replica, kill_in_flight, router_arguments, start_replica
from pagedserve.client.process import ServerProcess, free_port

from ..test_openai_gateway_limits import wait_for
from .conftest import ENGINE


def served(replica: Replica) -> float:
    """Prompt tokens this replica's engine has looked up: it grows with each request it runs."""
    return replica.counter(QUERIES)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    vllm_router.setup()  # once per machine: a venv under ~/.cache/pagedserve/peers
    workdir = tmp_path_factory.mktemp("replicas")
    started: list[Replica] = []
    try:
        for name in ("a", "b"):
            started.append(start_replica(workdir, name, {**ENGINE, "num_threads": "1"}))  # the two share 2 cores
        yield started
    finally:
        for replica in started:
            replica.stop()


def router(replicas: list[Replica], workdir: Path, policy: str, *extra: str) -> tuple[ServerProcess, openai.OpenAI]:
    port = free_port()
    process = vllm_router.start([r.url for r in replicas], port, workdir / f"router-{policy}.log", policy=policy,
                                extra=extra)
    return process, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


def which(replicas: list[Replica], before: list[float]) -> list[int]:
    return [i for i, r in enumerate(replicas) if served(r) > before[i]]


def chat_turns(conversation: int, turns: int, tag: str) -> list[dict[str, str]]:
    """A conversation's history up to its `turns`-th question (its own system line first; `tag` keeps
    one test's conversations apart from another's, whose blocks the replicas may still hold)."""
    history = [{"role": "system", "content": f"[{tag}] You are assistant number {conversation}. Answer briefly."}]
    for earlier in range(turns):
        history.append({"role": "user", "content": f"Question {earlier} of conversation {conversation}: name a colour."})
        if earlier < turns - 1:
            history.append({"role": "assistant", "content": f"Blue, for the {earlier + conversation}th time."})
    return history


@pytest.mark.parametrize("policy", ["cache_aware", "kv_aware"])
def test_prefix_aware_routing_keeps_each_conversation_where_its_history_is(replicas, tmp_path, policy):
    """Each turn after the first (one at a time, so the replica that ran it is known from the
    counters) lands on the replica that holds its history's KV blocks: its prefix-cache hits grow
    there. cache_aware places by the prompts it routed: the first turns go through it, together
    (where they land is its choice). kv_aware places by the blocks each replica's engine says it
    stored (its KV-cache events): the first turns go straight to the replicas, two to each, so the
    router learns where they are from the events alone. (A router started later never saw the
    events of blocks stored before it: each test's prompts are its own.)"""
    process, client = router(replicas, tmp_path, policy, "--log-level", "debug", *router_arguments(replicas, policy))
    direct = [openai.OpenAI(base_url=f"{r.url}/v1", api_key="none", max_retries=0, timeout=120) for r in replicas]

    def ask(conversation: int, turns: int, through: openai.OpenAI = client) -> None:
        through.chat.completions.create(model="llm", messages=chat_turns(conversation, turns, policy), max_tokens=6,
                                        temperature=0)

    try:
        first = [client] * 4 if policy == "cache_aware" else [direct[c % 2] for c in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(ask, range(4), [1] * 4, first))
        placed: dict[int, set[int]] = {}
        for turns in (2, 3, 4):
            for conversation in range(4):
                before = [served(r) for r in replicas]
                hits = [r.counter(HITS) for r in replicas]
                ask(conversation, turns)
                assert wait_for(lambda: len(which(replicas, before)) == 1, 10), "no single replica ran the turn"  # noqa: B023
                (where,) = which(replicas, before)
                assert replicas[where].counter(HITS) > hits[where], f"turn {turns} of {conversation} missed its history"
                placed.setdefault(conversation, set()).add(where)
        assert all(len(where) == 1 for where in placed.values()), placed
        if policy == "kv_aware":
            assert placed == {c: {c % 2} for c in range(4)}, placed
    finally:
        process.stop()


def test_a_killed_replica_costs_no_hang_and_comes_back_into_rotation(replicas, tmp_path):
    process, client = router(replicas, tmp_path, "round_robin")
    dead = replicas[0]
    try:
        counts = kill_in_flight(client, dead)  # errors other than the client's APIError are raised
        assert counts.hung == 0 and counts.completed + counts.failed == counts.sent
        assert counts.after_completed == counts.after_sent  # retried on the live replica, the dead one dropped
        dead.triton.start(timeout=300)  # back on its ports; its gateway never went away
        before = [served(r) for r in replicas]

        def asked() -> bool:
            client.chat.completions.create(model="llm", max_tokens=4, messages=[{"role": "user", "content": "Hello"}])
            return served(dead) > before[0]

        assert wait_for(asked, timeout=60), "the returned replica got no traffic"
    finally:
        process.stop()
        if not dead.triton.is_running():
            dead.triton.start(timeout=300)

