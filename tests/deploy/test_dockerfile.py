"""docker/Dockerfile, read (no container engine here to build it): the final stage
installs exactly the wheel a builder stage makes from the source, holds no source tree,
runs as the non-root UID the chart's securityContext names, and points every cache at
directories that user owns, the same paths the chart mounts writable volumes at.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .test_helm_chart import ROOT, manifests, named, server_container  # noqa: F401

DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / "docker" / "Dockerfile.dockerignore"
ROUTER_DOCKERFILE = ROOT / "docker" / "router.Dockerfile"
CACHE_ENV = ("PAGEDSERVE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME", "CUDA_CACHE_PATH")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [arguments for instruction, arguments in self.instructions if instruction == keyword]

    def env(self) -> dict[str, str]:
        found = {}
        for arguments in self.all("ENV"):
            for item in shlex.split(arguments):
                name, _, value = item.partition("=")
                found[name] = value
        return found


def stages(dockerfile: Path = DOCKERFILE) -> list[Stage]:
    """The Dockerfile's stages: instructions with continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in dockerfile.read_text().splitlines()
                                        if not line.lstrip().startswith("#")))
    found: list[Stage] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        instruction, _, arguments = line.strip().partition(" ")
        instruction, arguments = instruction.upper(), " ".join(arguments.split())
        if instruction == "FROM":
            base, _, name = arguments.partition(" AS ")
            found.append(Stage(base.strip(), name.strip() or None))
        else:
            found[-1].instructions.append((instruction, arguments))
    return found


@pytest.fixture(scope="module")
def final() -> Stage:
    return stages()[-1]


@pytest.fixture(scope="module")
def builder(final) -> Stage:
    [copy] = [c for c in final.all("COPY") if c.startswith("--from=")]
    name = copy.split()[0].removeprefix("--from=")
    return next(stage for stage in stages() if stage.name == name)


def test_final_stage_runs_as_the_charts_non_root_user(final, manifests):
    [user] = final.all("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and gid.isdigit(), "numeric, so Kubernetes' runAsNonRoot can check it"
    assert int(uid) != 0 and int(gid) != 0
    assert final.instructions[-1][0] == "CMD" and final.instructions[-2] == ("USER", user)  # nothing after runs as root
    pod = named(manifests["default"], "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(uid) and pod["securityContext"]["runAsGroup"] == int(gid)
    assert server_container(manifests["default"])["securityContext"]["runAsUser"] == int(uid)


def test_builder_makes_the_wheel_from_the_source(builder):
    [build] = [run for run in builder.all("RUN") if "pip wheel" in run]
    assert "--no-deps" in build and re.search(r"pip wheel .*--wheel-dir /wheel \.(\s|$)", build)
    copied = {source for arguments in builder.all("COPY") for source in arguments.split()[:-1]}
    setup = ast.parse((ROOT / "setup.py").read_text())
    parts = next(ast.literal_eval(node.value) for node in ast.walk(setup)
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "PARTS")
    # what the build reads: its configuration, the readme pyproject names, every package part
    assert {"pyproject.toml", "setup.py", "README.md", *parts} <= copied


def test_final_stage_installs_exactly_that_wheel_and_no_source(final, builder):
    copies = final.all("COPY")
    from_builder = [c for c in copies if c.startswith("--from=")]
    assert from_builder == [f"--from={builder.name} /wheel/ /tmp/wheel/"]
    for arguments in copies:
        sources = arguments.split()[:-1]
        assert not {"backend", "kernels", "client", "setup.py", "pyproject.toml", "."} & set(sources), arguments
    installs = [command for run in final.all("RUN") for command in run.split("&&") if "pip install" in command]
    ours = [command for command in installs if "pagedserve" in command and "requirements" not in command]
    assert [c.strip() for c in ours] == ["pip install --no-cache-dir --no-deps /tmp/wheel/pagedserve-*-py3-none-any.whl"]
    for command in installs:  # nothing installs the source tree (`.`, -e)
        words = command.split()
        assert "." not in words and "-e" not in words and "--editable" not in words, command


def test_caches_point_into_directories_the_user_owns(final):
    env = final.env()
    home, cache = env["HOME"], env["PAGEDSERVE_CACHE_DIR"]
    for name in CACHE_ENV:
        assert env[name] == cache or env[name].startswith(cache + "/"), name
    [made] = [run for run in final.all("RUN") if "install -d" in run]
    uid = final.all("USER")[0].split(":")[0]
    owned = set()
    for command in made.split("&&"):
        words = command.split()
        if words[:2] == ["install", "-d"]:
            assert words[words.index("-o") + 1] == uid and words[words.index("-g") + 1] == uid, command
            owned |= {w for w in words if w.startswith("/")}
    assert {home, cache} | {env[name] for name in CACHE_ENV} <= owned


def test_chart_mounts_writable_volumes_where_the_image_writes(final, manifests):
    """The chart's environment and volumes are the image's own paths (so `docker run` and
    the chart agree), and the model repository stays where the chart serves it from."""
    env = final.env()
    server = server_container(manifests["default"])
    chart_env = {e["name"]: e["value"] for e in server["env"]}
    for name in ("HOME", *CACHE_ENV):
        assert chart_env[name] == env[name], name
    mounts = {m["mountPath"] for m in server["volumeMounts"]}
    assert {env["HOME"], env["PAGEDSERVE_CACHE_DIR"], "/tmp", "/dev/shm"} <= mounts
    assert env["PAGEDSERVE_MODEL_REPOSITORY"] == "/opt/pagedserve/model_repository"
    assert any(c.split()[-1] == "./model_repository" for c in final.all("COPY"))
    assert final.all("WORKDIR")[-1] == "/opt/pagedserve"


def test_build_context_keeps_what_the_dockerfile_copies():
    """docker/Dockerfile.dockerignore leaves out the virtualenv and build outputs, never a
    file a COPY needs."""
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert {".venv", ".git", "build"} <= set(patterns)
    sources = {source for stage in stages() for arguments in stage.all("COPY") if not arguments.startswith("--from=")
               for source in arguments.split()[:-1]}
    for source in sources:
        assert (ROOT / source).exists(), source
        files = [source] if (ROOT / source).is_file() else [
            str(p.relative_to(ROOT)) for p in (ROOT / source).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".c", ".h", ".pbtxt", ".txt")]
        for path in files:
            ignored = [pattern for pattern in patterns
                       if fnmatch.fnmatch(path, pattern.removeprefix("**/")) or fnmatch.fnmatch(path, pattern)
                       or path.split("/")[0] == pattern]
            assert not ignored, f"{path} is copied but ignored by {ignored}"


def test_stage_parser_reads_this_file():
    found = stages()
    assert [stage.name for stage in found] == ["wheel", None]
    assert found[0].base == found[1].base == "nvcr.io/nvidia/tritonserver:26.09-py3"
    assert ("ENV", "PAGEDSERVE_MODEL_REPOSITORY=/opt/pagedserve/model_repository") in found[1].instructions


def test_router_image_is_the_tested_router_as_the_charts_user():
    """docker/router.Dockerfile installs the vllm-router version the integration test runs
    (benchmarks/peers/vllm_router.py), which the chart's router.image.tag defaults to, and runs
    as the chart's UID and GID."""
    import yaml

    from benchmarks.peers.vllm_router import VERSION

    [stage] = stages(ROUTER_DOCKERFILE)
    assert stage.all("ARG") == [f"VLLM_ROUTER_VERSION={VERSION}"]
    assert any('"vllm-router==${VLLM_ROUTER_VERSION}"' in run for run in stage.all("RUN"))
    assert stage.all("USER") == ["1000:1000"] and stage.all("ENTRYPOINT") == ['["vllm-router"]']
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "pagedserve" / "values.yaml").read_text())
    assert values["router"]["image"]["tag"] == VERSION
    assert values["podSecurityContext"]["runAsUser"] == values["podSecurityContext"]["runAsGroup"] == 1000
