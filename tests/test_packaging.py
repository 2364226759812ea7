"""A non-editable install carries every module of the app: the wheel holds every file under app/."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from tests.conftest import ROOT


def test_the_wheel_holds_every_module_of_the_app(tmp_path):
    # Built from a copy: setuptools reuses a build/ folder, which could hold modules the configuration leaves out.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "app", source / "app", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", source, "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path]
    subprocess.run(list(map(str, build)), check=True, capture_output=True, cwd=tmp_path, timeout=300)
    wheel = next(tmp_path.glob("amp_trainer-*.whl"))
    packed = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("app/")}
    sources = {str(path.relative_to(ROOT)) for path in (ROOT / "app").rglob("*.py")}
    assert sources - packed == set(), "modules a non-editable install would lack"
