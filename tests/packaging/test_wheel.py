"""The built wheel holds every module of core/ and plugins/ under the rlcore package, and its entry points."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(out), str(ROOT)], check=True)
    (found,) = list(out.glob("rlcore-*.whl"))
    return zipfile.ZipFile(found)


def expected_modules():
    mods = {f"rlcore/{p.relative_to(ROOT / 'core').as_posix()}" for p in (ROOT / "core").rglob("*.py")}
    mods |= {f"rlcore/plugins/{p.relative_to(ROOT / 'plugins').as_posix()}" for p in (ROOT / "plugins").rglob("*.py")}
    return {m for m in mods if "__pycache__" not in m}


@pytest.mark.slow
def test_wheel_contains_every_module(wheel):
    names = set(wheel.namelist())
    missing = sorted(expected_modules() - names)
    assert not missing, f"modules missing from the wheel (add their package to pyproject.toml): {missing}"
    assert not any(n.startswith(("core/", "plugins/")) for n in names)


@pytest.mark.slow
def test_wheel_declares_console_script_and_plugins(wheel):
    (ep,) = [n for n in wheel.namelist() if n.endswith("entry_points.txt")]
    text = wheel.read(ep).decode()
    assert "rlcore = rlcore.cli:main" in text
    for name in ("defaults", "streaming", "remesh", "rm-offload", "sparse-logging", "async"):
        assert f"{name} = rlcore.plugins." in text
    assert "[pytest11]" in text


def test_pyproject_lists_every_package():
    tomllib = pytest.importorskip("tomllib")

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    pkgs = {"rlcore" + ("." + ".".join(p.parent.relative_to(ROOT / "core").parts) if p.parent != ROOT / "core" else "")
            for p in (ROOT / "core").rglob("__init__.py")}
    pkgs.add("rlcore.plugins")
    assert pkgs <= listed, f"unlisted packages: {sorted(pkgs - listed)}"
