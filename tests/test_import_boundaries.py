"""The CPU backend's boundary, walked through the imports: kernel implementations (kernels/cpu/,
kernels/triton/) are reached only through kernels/dispatch.py or, for the C kernels, by the CPU
backend (backend/cpu/), whose weight layouts are theirs; the modules a GPU engine runs import
nothing CPU-only, neither written at their top nor loaded when they are imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("backend", "kernels", "client")  # pagedserve.<folder> (setup.py)
C_KERNELS, TRITON_KERNELS = "pagedserve.kernels.cpu", "pagedserve.kernels.triton"
CPU_BACKEND = "pagedserve.backend.cpu"
GPU_PATH = ("pagedserve.backend", "pagedserve.backend.engine", "pagedserve.backend.engine_thread",
            "pagedserve.backend.model_runner", "pagedserve.backend.models.llama", "pagedserve.backend.sampler",
            "pagedserve.backend.quantization", "pagedserve.backend.model_loader", "pagedserve.backend.device",
            "pagedserve.backend.distributed.worker", "pagedserve.backend.cuda_graphs",
            "pagedserve.backend.compiled_forward", "pagedserve.kernels.dispatch")


def modules() -> dict[str, Path]:
    """Every module of the package, by its dotted name."""
    found = {}
    for folder in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            parts = ("pagedserve", *path.relative_to(ROOT).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path) -> list[tuple[str, bool]]:
    """(module imported, whether at the module's top: not in a function, not for the type checker)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    found = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((alias.name, top) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                found.extend((f"{base}.{alias.name}", top) for alias in child.names)  # a module, or a name in one
                found.append((base, top))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, False)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, False)
            else:
                visit(child, top)

    visit(tree, True)
    return found


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_kernel_implementations_are_imported_only_by_dispatch_and_the_cpu_backend():
    wrong = []
    for name, path in modules().items():
        for target, _ in imports(name, path):
            for family in (C_KERNELS, TRITON_KERNELS):
                allowed = (within(name, family) or name == "pagedserve.kernels.dispatch"
                           or (family == C_KERNELS and within(name, CPU_BACKEND)))
                if within(target, family) and not allowed:
                    wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, "kernels are picked in kernels/dispatch.py (or by the CPU backend):\n" + "\n".join(sorted(set(wrong)))


def test_no_module_outside_the_cpu_backend_imports_cpu_only_code_at_its_top():
    wrong = []
    for name, path in modules().items():
        if within(name, CPU_BACKEND) or within(name, C_KERNELS):
            continue
        for target, top in imports(name, path):
            if top and (within(target, CPU_BACKEND) or within(target, C_KERNELS)):
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, "import CPU-only code where the device is the CPU, not at the top:\n" + "\n".join(sorted(set(wrong)))


def test_importing_the_gpu_path_loads_nothing_cpu_only():
    script = (f"import sys\nfor name in {GPU_PATH!r}: __import__(name)\n"
              f"print(sorted(m for m in sys.modules if m.startswith(({C_KERNELS!r}, {CPU_BACKEND!r}))))")
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout + loaded.stderr


def test_the_walk_sees_the_imports_it_polices():
    """The walk resolves relative imports and tells a function's import from a top-level one."""
    engine = dict.fromkeys([t for t, top in imports("pagedserve.backend.engine", ROOT / "backend/engine.py") if not top])
    assert "pagedserve.backend.cpu.backend" in engine  # made on CPU only, inside LLMEngine.__init__
    cpu_backend = imports("pagedserve.backend.cpu.backend", ROOT / "backend/cpu/backend.py")
    assert ("pagedserve.kernels.cpu.native_build", True) in cpu_backend
