"""The bundled tritonserver's set-up: what it refuses before starting, and the backend dir it builds."""

from __future__ import annotations

import pytest

from pagedserve.client import tritonserver_install
from pagedserve.client.tritonserver_install import TritonServerError, check_stub_numpy, prepare_backend_dir


@pytest.mark.parametrize("version", ["2.0.0", "2.5.2"])
def test_numpy_2_is_refused_before_the_server_starts_and_the_error_names_the_fix(version):
    with pytest.raises(TritonServerError) as error:
        check_stub_numpy(version)
    message = str(error.value)
    assert f"numpy {version}" in message and "numpy<2" in message and "24.11" in message


def test_numpy_1_passes():
    check_stub_numpy("1.26.4")


def wheel_server() -> str:
    root = tritonserver_install._wheel_server_root()
    if root is None:
        pytest.skip("nvidia-pytriton is not installed")
    return str(root / "bin" / "tritonserver")


def test_the_wheels_server_gets_a_python_backend_dir_with_the_stub_for_this_python(tmp_path):
    backends = prepare_backend_dir(tmp_path, wheel_server())
    assert backends is not None
    names = sorted(p.name for p in (tmp_path / "backends" / "python").iterdir())
    assert names == ["libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"]


def test_the_wheels_server_is_not_prepared_under_numpy_2(tmp_path, monkeypatch):
    server = wheel_server()
    monkeypatch.setattr(tritonserver_install.importlib.metadata, "version", lambda name: "2.1.0")
    with pytest.raises(TritonServerError, match="numpy 2.1.0"):
        prepare_backend_dir(tmp_path, server)
    assert not (tmp_path / "backends").exists()
