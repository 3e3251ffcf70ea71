"""Which torch releases flatgrad runs on: the floor, refused below at import.

``flatgrad/__init__.py`` imports this module before anything else, so that an older torch gets one clear
ImportError naming the floor instead of an AttributeError from deep inside the package. ``pyproject.toml``
declares the same floor (``torch>=2.4,<3``, checked by ``tests/test_torch_version.py``); CI runs
``tests/smoke_versions.py`` on the floor and on the newest release (``.ci/run``)."""

from __future__ import annotations

import re

import torch

TORCH_FLOOR = (2, 4)
"""The oldest torch release (major, minor) flatgrad supports: every public path is tested
there. Torch 2.4 lacks only the public state_dict hook registrations of 2.5
(`flatgrad._torch_compat` falls back to the private ones); 2.3 and older are not tested."""


def torch_release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: ``"2.4.1+cu121"`` -> (2, 4); a dev or
    pre-release build of a release counts as that release."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"torch version must start with <major>.<minor>, got {version!r}")
    return int(match.group(1)), int(match.group(2))


def require_supported_torch(version: str) -> None:
    """Raise ImportError when `version` is below `TORCH_FLOOR`.

    Args:
        version: A torch version string (``torch.__version__``).

    Raises:
        ImportError: When the release is older than the floor.
    """
    if torch_release(version) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(
            f"flatgrad needs torch >= {floor}, got torch {version}: install a newer torch "
            f"(pip install 'torch>={floor}')"
        )


require_supported_torch(torch.__version__)
