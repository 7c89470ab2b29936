"""Property-based requests over every input of `llm`, `ensemble`, `tensorrt_llm_bls` and the
OpenAI gateway (benchmarks/fuzz.py draws them from the models' config.pbtxt): each is answered
with a result or an error naming what was wrong, a bystander greedy stream beside them keeps
the tokens it gets alone, and no KV block is held after. The long run is
`python benchmarks/fuzz.py --examples 2000`."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import HealthCheck, Phase, given, settings

from benchmarks.fuzz import GATEWAY_KEY, Bystander, Report, bystander_text, cases, send

from .conftest import gateway_process, metric, wait_idle

EXAMPLES = 250
BUDGET_S = 6.0


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz_gateway") / "gateway.log"
    command = [sys.executable, "-m", "pagedserve.client.cli", "openai", "--triton-url", server.grpc_url]
    with gateway_process(command, log, env={**os.environ, "PAGEDSERVE_API_KEY": GATEWAY_KEY}) as url:
        yield url


def test_every_input_gets_a_result_or_a_named_error_and_harms_no_bystander(server, gateway):
    wait_idle(server)
    bystander = Bystander(server.grpc_url, bystander_text(server.grpc_url))
    report = Report()

    @settings(max_examples=EXAMPLES, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def each_case(case):
        report.add(case, send(case, server.grpc_url, gateway, budget_s=BUDGET_S))

    bystander.start()
    try:
        each_case()
    finally:
        bystander.stop()
    print("\n" + report.table())
    crashes = [f"{case.entry} {case.kind}: {message[:200]}" for case, message in report.crashes]
    assert not crashes, "\n".join(crashes)
    assert bystander.runs >= 1 and not bystander.errors and not bystander.mismatches
    wait_idle(server, timeout=60)
    assert metric(server, "pagedserve:kv_blocks_used") == 0
