"""benchmarks/core_accounting.py: a point's CPU and waits land in the serving path's parts,
by process and thread name, threads that ended within the window included."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # after everything: its scripts shadow nothing

from core_accounting import CoreWindow, _process_tree, busy_cores  # noqa: E402

from pagedserve.backend.process_tuning import name_native_thread  # noqa: E402

pytestmark = pytest.mark.skipif(not CoreWindow.supported(), reason="reads Linux /proc schedstat")


def spin(seconds: float, name: str | None = None) -> None:
    if name:
        name_native_thread(name)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_this_process_counts_as_one_part_with_threads_that_ended_in_the_window():
    window = CoreWindow(None, "engine")
    window.start()
    worker = threading.Thread(target=spin, args=(0.3,))
    worker.start()
    worker.join()  # gone from /proc before the window ends: its CPU stays in the process's total
    use = window.stop()
    assert set(use.parts) == {"engine"}
    assert use.parts["engine"].cpu_s >= 0.25
    assert use.us_per("engine", 1000) == pytest.approx(use.parts["engine"].cpu_s * 1e3)


# A stand-in for tritonserver: it spins a little and starts a "stub" (named as Triton's python
# stubs are) whose engine and response threads carry our names, and one more thread that does not.
SERVER = textwrap.dedent("""
    import subprocess, sys, time
    from pagedserve.backend.process_tuning import name_native_thread
    STUB = '''
    import threading, time
    from pagedserve.backend.process_tuning import name_native_thread
    def spin(seconds, name):  # then stay: a thread that ends takes its name with it
        name_native_thread(name)
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        time.sleep(60)
    name_native_thread("triton_python_backend_stub")
    print("ready", flush=True)
    input()
    for args in ((0.4, "pagedserve-engine"), (0.2, "pagedserve-responses"), (0.1, "other")):
        threading.Thread(target=spin, args=args, daemon=True).start()
    time.sleep(60)
    '''
    stub = subprocess.Popen([sys.executable, "-c", STUB], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stub.stdout.readline()
    print("ready", flush=True)
    stub.stdin.write(input() + chr(10)); stub.stdin.flush()
    end = time.thread_time() + 0.15
    while time.thread_time() < end:
        pass
    time.sleep(60)
""")


def test_a_servers_stub_threads_are_told_apart_by_name():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        window = CoreWindow(server.pid, "load generator")
        window.start()
        server.stdin.write("go\n")
        server.stdin.flush()
        time.sleep(3.0)  # the stand-ins' spins: 0.4 + 0.2 + 0.1 s in the stub, 0.15 s in the server
        use = window.stop()
    finally:
        for pid in reversed(_process_tree(server.pid)):  # the stub, then the server
            os.kill(pid, signal.SIGKILL)
        server.wait()
    cpu = {part: times.cpu_s for part, times in use.parts.items()}
    assert cpu["engine"] == pytest.approx(0.4, abs=0.08)
    assert cpu["response thread"] == pytest.approx(0.2, abs=0.08)
    assert 0.05 <= cpu["stubs, other"] <= 0.3  # the unnamed thread (a process's total moves in 10 ms ticks)
    assert 0.1 <= cpu["tritonserver"] <= 0.4
    assert cpu["load generator"] < 0.5  # this test's process, sleeping


def test_busy_cores_sees_a_thread_spinning():
    spinner = threading.Thread(target=spin, args=(1.0,))
    spinner.start()
    try:
        assert busy_cores(0.5) >= 0.7
    finally:
        spinner.join()
