"""`flatgrad._torch_version`: the torch floor, refused below at import, and the same floor
declared in ``pyproject.toml`` (read as text: ``tomllib`` is not in Python 3.10)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from flatgrad import _torch_version

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


@pytest.mark.parametrize("version", ["2.3.1", "2.3.0+cpu", "1.13.1", "2.0.0a0+gitabc"])
def test_a_torch_below_the_floor_is_refused_naming_the_floor(version):
    with pytest.raises(ImportError, match=rf"flatgrad needs torch >= 2\.4, got torch {re.escape(version)}"):
        _torch_version.require_supported_torch(version)


@pytest.mark.parametrize("version", ["2.4.0", "2.4.1+cu121", "2.4.0a0+git1234", "2.15.0", "3.0.0"])
def test_the_floor_and_newer_are_accepted(version):
    _torch_version.require_supported_torch(version)


def test_a_version_without_major_minor_is_an_error():
    with pytest.raises(ValueError, match="torch version must start with <major>.<minor>, got 'nightly'"):
        _torch_version.torch_release("nightly")


def test_pyproject_declares_the_floor():
    floor = ".".join(map(str, _torch_version.TORCH_FLOOR))
    declared = re.findall(r'"torch([<>=!~][^"]*)"', PYPROJECT.read_text())  # (not torchao)
    assert declared == [f">={floor},<3"], declared


def test_importing_flatgrad_under_an_old_torch_raises_that_error_first():
    """A fresh interpreter whose torch says 2.3.1: ``import flatgrad`` fails with the floor's
    ImportError, before any other module reads a torch name."""
    code = "import torch; torch.__version__ = '2.3.1'; import flatgrad"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "ImportError: flatgrad needs torch >= 2.4, got torch 2.3.1: install a newer torch "
        "(pip install 'torch>=2.4')"
    ), result.stderr
