"""The committed model repository loads on a fresh checkout, and copies of it keep every model."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pagedserve.client.repository import source_repository, write_repository

MODELS = sorted(p.parent.name for p in source_repository().glob("*/config.pbtxt"))


def tracked_files(directory: Path) -> list[str]:
    """Files git tracks under directory: what a fresh clone (CI, a user) gets."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    result = subprocess.run(["git", "ls-files", "--", "."], cwd=directory, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip("not a git checkout")
    return result.stdout.split()


@pytest.mark.parametrize("model", MODELS)
def test_every_model_has_a_tracked_version_directory(model):
    # Triton refuses a model with no version directory ("at least one version must be
    # available"); git drops empty directories, so the ensemble's 1/ needs a placeholder file.
    assert tracked_files(source_repository() / model / "1"), f"model_repository/{model}/1/ is empty in git"


def test_a_written_copy_has_every_model_and_version(tmp_path):
    copy = write_repository(tmp_path / "repo", engine={"max_num_seqs": "4"})
    assert sorted(p.parent.name for p in copy.glob("*/config.pbtxt")) == MODELS
    assert all((copy / model / "1").is_dir() for model in MODELS)
    assert 'key: "max_num_seqs" value: { string_value: "4" }' in (copy / "llm" / "config.pbtxt").read_text()
