"""vLLM's router (`vllm-router` on PyPI: Rust, cache-aware and KV-aware policies) in front of
pagedserve replicas: set up on request in its own virtualenv (never a project dependency), run
as its own process.

    python benchmarks/peers/vllm_router.py --setup     # create the venv (downloads; about a minute)

The venv lives in $PAGEDSERVE_PEERS_DIR (default ~/.cache/pagedserve/peers/vllm-router). Each
pagedserve replica is a tritonserver with the `pagedserve openai` gateway in front: the gateway's
URL is the router's worker URL (it answers /health, the OpenAI routes, and the render and
tokenize routes the router asks every worker before it places a request by prefix).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from pagedserve.client.process import ServerProcess, free_port, http_status

VERSION = "0.1.17"
READY_PATH = "/readiness"
"""The router answers GET READY_PATH with 200 once it has a healthy worker."""


def peers_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_PEERS_DIR", Path.home() / ".cache" / "pagedserve" / "peers"))


def venv_dir() -> Path:
    return peers_dir() / f"vllm-router-{VERSION}"


def router_binary() -> Path:
    return venv_dir() / "bin" / "vllm-router"


def setup() -> Path:
    """The venv with vllm-router VERSION (made once; later calls return at once)."""
    binary = router_binary()
    if binary.exists():
        return binary
    venv = venv_dir()
    print(f">> creating {venv} with vllm-router=={VERSION}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + [f"vllm-router=={VERSION}"], check=True)
    subprocess.run([str(binary), "--help"], check=True, stdout=subprocess.DEVNULL)
    return binary


def command(workers: Sequence[str], port: int, policy: str = "cache_aware", health_interval_s: int = 1,
            extra: Sequence[str] = ()) -> list[str]:
    """The router's command line over `workers` (base URLs), checking their health every
    `health_interval_s` (a dead replica leaves the rotation after 3 failed checks); its Prometheus
    exporter on a free port (its default, 29000, may be taken: the router then panics at start)."""
    return [str(router_binary()), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port(exclude={port})),
            "--worker-urls", *workers, "--health-check-interval-secs", str(health_interval_s),
            "--health-check-timeout-secs", "2", "--worker-startup-check-interval", "1",
            "--retry-initial-backoff-ms", "100", "--retry-max-backoff-ms", "2000", *extra]


def start(workers: Sequence[str], port: int, log_file: str | os.PathLike, policy: str = "cache_aware",
          health_interval_s: int = 1, extra: Sequence[str] = (), timeout_s: float = 60.0) -> ServerProcess:
    """The router running over `workers`, once it reports a healthy worker."""
    router = ServerProcess(command(workers, port, policy, health_interval_s, extra), log_file, name="vllm-router").start()
    router.wait_ready(lambda: http_status(f"http://127.0.0.1:{port}{READY_PATH}") == 200, time.monotonic() + timeout_s)
    return router


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help="create the venv")
    args = parser.parse_args()
    if args.setup:
        print(setup())
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
