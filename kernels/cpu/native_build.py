"""Building the CPU kernels written in C (paged_decode.c, rms_norm.c, ...) on the
machine that runs them.

Why there: `-march=native` code is the point (AVX-512, AVX512-BF16 where the CPU has them)
and it only runs where it was built, so each machine builds its own, with the C compiler
inductor also uses ($CC, else cc), cached in kernels/ of the project's cache directory
(`cache_root()`), keyed by source, flags and CPU. When: at install (`make install` runs
`pagedserve build-kernels`, `build_all`), and again by a CPU engine at load for any the
cache lacks (another CPU, changed sources); a kernel first used before either is built then,
as a fallback (tests that rebuild for another -march do so). The libraries
link libgomp, which resolves to the OpenMP runtime torch has already loaded: their
threads are torch's.
No compiler, a failed build, or PAGEDSERVE_NATIVE_CPU=0: `NativeLibrary.get()` returns
None (with one warning naming the cause) and callers run their torch ops instead.
PAGEDSERVE_CPU_MARCH=x86-64-v3 (any gcc -march) builds an older instruction set's code
instead of the CPU's own: how a machine with AVX-512 measures what an AVX2-only one runs.
For tests, PAGEDSERVE_CPU_MARCH=simde-avx512 or simde-avx512bf16 (EMULATED) builds the
AVX-512 (with AVX512-BF16) code for a CPU without it, every intrinsic emulated in portable C by
SIMDe (kernels/cpu/cpu_simde.h; headers from the simde-py package): slow, but the same code paths,
so an AVX2 machine tests what AVX-512 ones run.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from ..cache_dir import cache_root

logger = logging.getLogger("pagedserve")

FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
DISABLE_ENV = "PAGEDSERVE_NATIVE_CPU"
"""Set to 0 to keep every CPU kernel on torch ops (benchmarks compare the two)."""
MARCH_ENV = "PAGEDSERVE_CPU_MARCH"
"""gcc's -march for every C kernel (default native)."""


EMULATED = {
    "simde-avx512": ["-DPAGEDSERVE_EMULATE_AVX512"],
    "simde-avx512bf16": ["-DPAGEDSERVE_EMULATE_AVX512", "-DPAGEDSERVE_EMULATE_AVX512BF16"],
}
"""The `march` values that build AVX-512 code emulated by SIMDe (tests only): the defines
kernels/cpu/cpu_simde.h reads."""

C_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The dtype codes the C kernels take (cpu_dtypes.h)."""


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_signature() -> str:
    """The CPU model and flags: -march=native code runs only where it was built, so they key
    the build (and the matmul probe's verdict, backend/cpu/matmul_probe.py)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "\n" + "\n".join(lines)


def simde_include() -> str | None:
    """The folder holding SIMDe's headers (simde/x86/avx512.h) from the simde-py package; None
    without it (the emulated builds are then unavailable)."""
    try:
        import simde_py
    except ImportError:
        return None
    folder = Path(simde_py.get_include())
    return str(folder) if (folder / "simde" / "x86" / "avx512.h").is_file() else None


def march_flags(march: str) -> list[str]:
    """gcc's flags for `march`: -march=<it>, or for an EMULATED name the CPU's own code (older
    than AVX-512: SIMDe must not find it native) with SIMDe force-included."""
    if march not in EMULATED:
        return [f"-march={march}"]
    include = simde_include()
    if include is None:
        raise RuntimeError(f"{march}: SIMDe's headers are not installed (pip install simde-py)")
    host = "x86-64-v3" if "avx512f" in cpu_signature().split() else "native"
    version = importlib.metadata.version("simde-py")  # in the flags, so in the build's cache key
    # -O1: at -O3 gcc takes ~7 min over paged_decode.c's 32 inlined variants of emulated code
    return ["-O1", f"-march={host}", "-Wno-psabi", f"-DPAGEDSERVE_SIMDE_PY={version}", "-I", include,
            "-include", str(Path(__file__).with_name("cpu_simde.h")), *EMULATED[march]]


def build(source: Path, cc: str, march: str = "native") -> Path:
    """The shared library of `source` for these flags and this CPU, compiled unless cached.
    Written under a temporary name and renamed, so concurrent loads never see half a file.
    `march` other than native: an older instruction set's code, or an EMULATED one (tests run
    each one the CPU can)."""
    flags = [*FLAGS, *march_flags(march)]
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h"))  # what it may #include
                       if march in EMULATED or h.name != "cpu_simde.h")
    inputs = source.read_bytes() + headers + " ".join([cc, *flags]).encode() + cpu_signature().encode()
    key = hashlib.sha256(inputs).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        done = subprocess.run([cc, *flags, str(source), "-o", str(partial), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed ({done.returncode}): {done.stderr.strip()[-600:]}")
        os.replace(partial, target)
    return target


LIBRARIES: list[NativeLibrary] = []
"""Every NativeLibrary made in this process (one per kernel module, made at its import): the
tests rebuild them all for another -march through this list."""


class NativeLibrary:
    """One C source, built and loaded once per process on first `get()`; `declare` sets its
    functions' ctypes signatures once, after loading, and returns False where the library has
    nothing for this CPU (code for an instruction set it lacks): `get()` is None there, as
    without a compiler, so callers fall back once instead of being declined on every call."""

    def __init__(self, source: Path, what: str, fallback: str, declare: Callable[[ctypes.CDLL], bool | None]):
        self.source, self.what, self.fallback, self.declare = source, what, fallback, declare
        self._lock = threading.Lock()
        self._loaded: list[ctypes.CDLL | None] = []
        LIBRARIES.append(self)

    def get(self) -> ctypes.CDLL | None:
        if self._loaded:  # every call after the first: no lock on the step's hot path
            return self._loaded[0]
        with self._lock:
            if not self._loaded:
                self._loaded.append(self.load())
            return self._loaded[0]

    def load(self, march: str | None = None) -> ctypes.CDLL | None:
        """Build and load now (no memo; tests call it with a changed environment or `march`;
        None: $PAGEDSERVE_CPU_MARCH, else native)."""
        if os.environ.get(DISABLE_ENV, "1") == "0":
            return None
        cc = compiler()
        if cc is None:
            logger.warning("%s: no C compiler (set CC or install gcc); using %s", self.what, self.fallback)
            return None
        try:
            library = ctypes.CDLL(str(build(self.source, cc, march or os.environ.get(MARCH_ENV) or "native")))
        except (OSError, RuntimeError) as exc:
            logger.warning("%s: build failed, using %s: %s", self.what, self.fallback, exc)
            return None
        if self.declare(library) is False:
            logger.info("%s: no code for this CPU's instruction set; using %s", self.what, self.fallback)
            return None
        return library


def build_all(report: Callable[[str], None] | None = None) -> dict[str, bool]:
    """Build (or find built) every C kernel for this CPU now, one per core at a time: what
    `pagedserve build-kernels` and `make install` run, and a CPU engine at load, so no request
    and no test pays a compile. Which kernels there are is read from the folder (each
    `<name>.c` is bound by the module `<name>`), so a new kernel needs no list kept here.
    Returns {kernel: built}; `report` gets a line per kernel as it finishes."""
    import importlib
    from concurrent.futures import ThreadPoolExecutor

    for source in sorted(Path(__file__).parent.glob("*.c")):
        importlib.import_module(f"{__package__}.{source.stem}")

    def one(library: NativeLibrary) -> tuple[str, bool]:
        started = time.perf_counter()
        built = library.get() is not None
        if report is not None:
            state = "ready" if built else f"not built (the engine uses {library.fallback})"
            report(f"{library.source.stem}: {state} ({time.perf_counter() - started:.1f} s)")
        return library.source.stem, built

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return dict(pool.map(one, LIBRARIES))


__all__ = ["C_DTYPES", "DISABLE_ENV", "EMULATED", "MARCH_ENV", "NativeLibrary", "build", "build_all", "compiler",
           "simde_include"]
