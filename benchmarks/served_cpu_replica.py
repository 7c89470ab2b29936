"""What the serving path's CPU costs the engine, without Triton: offline decode steps alone
and beside a replica of the work the other processes do per streamed token.

Served on two cores, a streamed token costs CPU outside the engine: our response thread
(builds the response, then waits for tritonserver to take it), tritonserver (hands it to
gRPC) and the client (reads it). This runs `LLMEngine.step` on a batch of decoding
sequences and times the step:

- alone: nothing else running;
- chain: a thread in the engine's process spinning --response-us per output and waiting on a
  pipe for a second process, which spins --server-us, answers and passes the message to a
  third, which spins --client-us (the served path's shape);
- chain-ext: the same, the first link in its own process;
- timer: the chain's CPU per step from one process that wakes on a timer.

If the three replicas cost the step alike, the amount of CPU is what costs, not the pattern of
wake-ups. Defaults: the per-token CPU measured served on a 2-core Zen 4 (RESULTS.md, "Who takes
the CPU from the served engine at 32 streams"). Each mode runs in a fresh process:

    python benchmarks/served_cpu_replica.py [--rows 32] [--seconds 20] [--modes alone,chain,chain-ext,timer]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import random
import subprocess
import sys
import threading
import time

MODES = ("alone", "chain", "chain-ext", "timer")


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def server_link(inbox: int, turn: int, onward: int, us: float) -> None:
    while os.read(inbox, 1):
        spin(us)
        os.write(turn, b"t")  # the sender may go on, as tritonserver answers a stub's send
        os.write(onward, b"m")


def client_link(inbox: int, us: float) -> None:
    while os.read(inbox, 1):
        spin(us)


def send_outputs(count: int, to_server: int, turn: int, us: float) -> None:
    for _ in range(count):
        spin(us)
        os.write(to_server, b"r")
        os.read(turn, 1)


def response_thread(outbox: queue.Queue, to_server: int, turn: int, us: float) -> None:
    for count in iter(outbox.get, None):
        send_outputs(count, to_server, turn, us)


def response_process(steps: int, to_server: int, turn: int, us: float) -> None:
    while message := os.read(steps, 4):
        send_outputs(int.from_bytes(message, "little"), to_server, turn, us)


def timer_load(period_s: float, busy_us: float) -> None:
    while True:
        spin(busy_us)
        time.sleep(max(0.0, period_s - busy_us * 1e-6))


def run_one(args: argparse.Namespace) -> float:
    """ms per decode step in this process, with args.one's replica running beside it."""
    mode = args.one
    to_server_r, to_server_w = os.pipe()
    turn_r, turn_w = os.pipe()
    onward_r, onward_w = os.pipe()
    steps_r, steps_w = os.pipe()
    helpers = []
    if mode in ("chain", "chain-ext"):
        helpers += [mp.Process(target=server_link, args=(to_server_r, turn_w, onward_w, args.server_us), daemon=True),
                    mp.Process(target=client_link, args=(onward_r, args.client_us), daemon=True)]
    if mode == "chain-ext":
        helpers.append(mp.Process(target=response_process, args=(steps_r, to_server_w, turn_r, args.response_us), daemon=True))
    if mode == "timer":
        per_token = args.response_us + args.server_us + args.client_us
        busy_us = per_token * args.rows * args.timer_period_ms / args.step_ms  # the chain's CPU share
        helpers.append(mp.Process(target=timer_load, args=(args.timer_period_ms * 1e-3, busy_us), daemon=True))
    for helper in helpers:
        helper.start()

    from pagedserve.backend import LLMEngine, SamplingParams

    engine = LLMEngine(dtype=args.dtype, max_num_seqs=args.rows, num_kv_blocks=4096, enable_prefix_caching=False)
    rng = random.Random(0)
    for _ in range(args.rows):
        prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
        engine.add_request(prompt, SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True))
    for _ in range(5):  # the prefill, and a few decodes
        engine.step()
    outbox: queue.Queue[int] = queue.Queue()
    if mode == "chain":
        threading.Thread(target=response_thread, args=(outbox, to_server_w, turn_r, args.response_us), daemon=True).start()
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < args.seconds:
        outputs = engine.step()
        steps += 1
        if mode == "chain":
            outbox.put(len(outputs))
        elif mode == "chain-ext":
            os.write(steps_w, len(outputs).to_bytes(4, "little"))
    return 1000 * (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32, help="sequences decoding (the concurrency)")
    parser.add_argument("--prompt-len", type=int, default=150)
    parser.add_argument("--seconds", type=float, default=20.0, help="decode time per mode")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--response-us", type=float, default=110.0,
                        help="our response thread's CPU per token (before its send waits)")
    parser.add_argument("--server-us", type=float, default=60.0, help="tritonserver's CPU per token")
    parser.add_argument("--client-us", type=float, default=250.0, help="the client's CPU per token")
    parser.add_argument("--step-ms", type=float, default=45.0,
                        help="the step time alone, to size the timer load (the alone mode's own time when it ran first)")
    parser.add_argument("--timer-period-ms", type=float, default=2.0)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(f"{run_one(args):.3f}", flush=True)
        return
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    per_step = (args.response_us + args.server_us + args.client_us) * args.rows / 1000
    print(f"{args.rows} rows, {args.dtype}, {args.seconds:.0f} s a mode; replica CPU {per_step:.1f} ms a step", flush=True)
    times: dict[str, float] = {}
    for mode in modes:
        print(f"[{mode}] running ...", flush=True)
        sized = ["--step-ms", f"{times['alone']:.3f}"] if "alone" in times else []
        child = subprocess.run([sys.executable, __file__, *sys.argv[1:], *sized, "--one", mode],
                               capture_output=True, text=True, check=True)
        times[mode] = float(child.stdout.strip().splitlines()[-1])
        print(f"[{mode}] {times[mode]:.2f} ms a step", flush=True)
    base = times.get("alone")
    print("\n| mode | ms per decode step | vs alone |\n|---|---:|---:|")
    for mode, ms in times.items():
        print(f"| {mode} | {ms:.2f} | {f'{ms / base:.2f}x' if base else '-'} |")


if __name__ == "__main__":
    main()
