"""optiq installs as one package: the kernels and the catalog live inside its namespace, so nothing in the working
directory, and no other distribution, takes their place."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from optiq import compile_ahead
from optiq.catalog.recipes import load_catalog

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """optiq built from this tree and installed into an empty folder, without its dependencies."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-cache-dir", "--target", str(target), str(REPO)], check=True, timeout=300)
    return target


def test_the_wheel_installs_no_top_level_package_but_optiq(installed):
    top = sorted(p.name for p in installed.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin")
    assert top == ["optiq"]
    assert (installed / "optiq" / "fusions" / "rmsnorm.py").is_file()
    assert not (installed / "optiq" / "fusions").is_symlink()
    assert sorted(p.name for p in (installed / "optiq" / "builtin_recipes").glob("*.toml")) == sorted(
        f"{name}.toml" for name in load_catalog())


def _decoy(folder: Path) -> Path:
    """A working directory holding a ``fusions`` package and a ``recipes`` folder that would break optiq if used."""
    (folder / "fusions").mkdir(parents=True)
    (folder / "fusions" / "__init__.py").write_text("raise ImportError('the decoy fusions package was imported')\n")
    (folder / "fusions" / "rmsnorm.py").write_text("raise ImportError('the decoy kernel was imported')\n")
    (folder / "recipes").mkdir()
    (folder / "recipes" / "rmsnorm.toml").write_text("this is not a recipe\n")
    (folder / "recipes" / "decoy.toml").write_text('name = "decoy"\n')
    return folder


PROBE = """
import json, optiq.fusions.rmsnorm as kernel
from optiq.catalog.recipes import load_catalog
from optiq.patching import resolve
catalog = load_catalog()
print(json.dumps({"kernel": kernel.__file__, "catalog": sorted(catalog),
                  "paths": sorted({r.path.rsplit("/", 1)[0] for r in catalog.values()}),
                  "resolved": resolve(catalog["rmsnorm"], "fusion", catalog["rmsnorm"].fusion).__module__}))
"""


@pytest.mark.parametrize("where", ["checkout", "installed"])
def test_a_decoy_fusions_or_recipes_folder_in_the_working_directory_changes_nothing(tmp_path, installed, where):
    root = REPO if where == "checkout" else installed
    env = {**os.environ, "PYTHONPATH": str(root)}
    # ``-c`` puts the working directory first on the path, as ``python -m`` does.
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=_decoy(tmp_path / "cwd"), env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["kernel"] == str(root / "optiq" / "fusions" / "rmsnorm.py")
    assert found["catalog"] == sorted(load_catalog()) and "decoy" not in found["catalog"]
    assert found["paths"] == [str(root / "optiq" / "builtin_recipes")]
    assert found["resolved"] == "optiq.fusions.rmsnorm"


def test_compile_workers_import_the_optiq_that_started_them(tmp_path):
    """A worker runs ``python -P -m optiq.compile_ahead`` with this optiq first on its path: an ``optiq`` folder in
    the working directory is never the one it imports."""
    decoy = tmp_path / "cwd"
    (decoy / "optiq").mkdir(parents=True)
    (decoy / "optiq" / "__init__.py").write_text("raise ImportError('the decoy optiq was imported')\n")
    proc = subprocess.run([sys.executable, "-P", "-c", "import optiq; print(optiq.__file__)"], cwd=decoy,
                          env=compile_ahead._same_optiq(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()).parent == Path(compile_ahead.__file__).resolve().parent
