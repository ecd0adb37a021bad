"""The distribution: `pip install .` ships every library package, and the Space's requirements.txt installs
every library dependency at the version pyproject.toml pins."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[1]
#: Folders with an __init__.py that run from a checkout and are not installed.
CHECKOUT_ONLY = {"tests"}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def requirement_name(line: str) -> str:
    return re.split(r"[\[=<>!~; ]", line, maxsplit=1)[0].lower().replace("_", "-")


def test_every_library_package_is_installed() -> None:
    include = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    installed = set(find_packages(str(REPO), include=include))
    packages = {
        ".".join(init.parent.relative_to(REPO).parts)
        for init in REPO.glob("**/__init__.py")
        if init.relative_to(REPO).parts[0] not in {*CHECKOUT_ONLY, "data", "jobs", "build"}
    }
    assert packages == installed


def test_requirements_txt_installs_every_dependency_as_pinned() -> None:
    lines = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    required = {requirement_name(line): line for line in lines if line}
    for dependency in pyproject()["project"]["dependencies"]:
        name = requirement_name(dependency)
        assert name in required, f"requirements.txt lacks {dependency}"
        assert required[name] == dependency, f"requirements.txt has {required[name]!r}, pyproject {dependency!r}"
