"""What `pip install .` (not `-e`) ships: a wheel built from this tree holds the demo's configs, and the CLI's lookup
finds them in the installed package when run from another directory, so `hybridrl demo` works without a checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIGS = [f"hybridrl/config/demo/{name}.yaml" for name in ("arithmetic_sft", "arithmetic_grpo", "arithmetic_ppo",
                                                                  "tools_sft", "tools_grpo")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the tree (setuptools writes build/ and *.egg-info next to the sources)."""
    pytest.importorskip("setuptools")
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "hybridrl", source / "hybridrl", ignore=shutil.ignore_patterns("__pycache__"))
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                             "-q", "-w", str(out), str(source)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (path,) = out.glob("hybridrl-*.whl")
    return path


def test_the_wheel_holds_the_demo_configs(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert [name for name in DEMO_CONFIGS if name not in names] == []


def test_the_installed_cli_finds_the_demo_configs_from_another_directory(wheel, tmp_path):
    """The wheel unpacked as site-packages would hold it, imported from an empty directory (no checkout on the
    path): `DEMO_CONFIGS` points into the installed package and each config loads."""
    site, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere.mkdir()
    code = ("import hybridrl, hybridrl.cli as cli\n"
            "from hybridrl.config.loading import load_config\n"
            "print(hybridrl.__file__)\n"
            "for name in ('sft', 'grpo', 'ppo'):\n"
            "    load_config(cli.DEMO_CONFIGS / f'arithmetic_{name}.yaml')\n"
            "print(cli.DEMO_CONFIGS)\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=dict(env, PYTHONPATH=str(site)),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    package_file, demo_configs = result.stdout.split()
    assert Path(package_file).is_relative_to(site) and Path(demo_configs) == site / "hybridrl/config/demo"
