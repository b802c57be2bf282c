"""`speclab.gpus`, the package's one reader of nvidia-smi, against a stand-in nvidia-smi on PATH
that answers as a two-H200 machine does (and, as controls, none on PATH and one that fails);
the fingerprint, the memory check, preflight and gpubench read their GPUs through it."""

import os
import stat
from pathlib import Path

import pytest

from speclab import fingerprint, gpubench, gpus, memory, preflight, profiles

SMI = """#!/bin/sh
# a stand-in for nvidia-smi on a machine with two H200s (one of them 5 GiB in use)
case "$*" in
  "--query-gpu=name --format=csv,noheader,nounits")
    printf 'NVIDIA H200\\nNVIDIA H200\\n' ;;
  "--query-gpu=memory.total,memory.used --format=csv,noheader,nounits")
    printf '143771, 5120\\n143771, 0\\n' ;;
  "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader,nounits")
    printf '1755, 612.30, 58, 0x0000000000000004\\n1980, 80.10, 40, 0x0000000000000001\\n' ;;
  *) echo "unexpected arguments: $*" >&2; exit 9 ;;
esac
"""


def _path_with(tmp_path: Path, body: str | None) -> str:
    """PATH holding only a folder with `body` as nvidia-smi (None: no nvidia-smi at all) and
    the shell it runs on."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    if body is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(body)
        smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    return os.pathsep.join([str(bin_dir), "/bin", "/usr/bin"])


@pytest.fixture
def two_h200(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _path_with(tmp_path, SMI))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fingerprint.hardware.cache_clear()
    yield
    fingerprint.hardware.cache_clear()


def test_names_count_and_memory_of_a_two_gpu_machine(two_h200, monkeypatch):
    assert gpus.names() == ["NVIDIA H200", "NVIDIA H200"]
    assert gpus.visible_count() == 2
    assert gpus.memory_gib() == (143771 / 1024, 5.0)
    assert gpus.memory_gib(1) == (143771 / 1024, 0.0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpus.visible_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus.visible_count() == 0


def test_every_reader_of_the_machine_sees_the_same_gpus(two_h200):
    assert fingerprint.hardware()["gpus"] == ["NVIDIA H200", "NVIDIA H200"]
    assert memory.local_gpu_name() == "NVIDIA H200" and memory.local_gpu() == "H200"
    prof = profiles.load("tiny-cpu", {"backend": "cuda", "grid": {"layout": [{"tp": 4}]}})
    assert "needs 4 GPUs (largest TP x DP in grid.layout), 2 visible" in \
        preflight.check_env(prof)
    assert gpubench.gpus is gpus  # its memory checks read gpus.memory_gib


def test_no_nvidia_smi_means_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _path_with(tmp_path, None))
    fingerprint.hardware.cache_clear()
    assert gpus.names() == [] and gpus.visible_count() == 0
    assert fingerprint.hardware()["gpus"] == [] and memory.local_gpu_name() == ""
    fingerprint.hardware.cache_clear()
    with pytest.raises(FileNotFoundError, match="nvidia-smi is not on PATH"):
        gpus.memory_gib()


def test_a_failing_nvidia_smi_reads_as_no_gpu_but_memory_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _path_with(tmp_path, "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\n"
                                                    "exit 9\n"))
    assert gpus.names() == [] and gpus.visible_count() == 0
    with pytest.raises(Exception, match="returned non-zero exit status 9"):
        gpus.memory_gib()


def test_clocks_power_and_event_reasons_of_each_gpu(two_h200):
    """The host sampler's GPU reading: the first H200 power-capped (0x4) at 1,755 MHz."""
    assert gpus.clocks() == {"sm_mhz": 1755.0, "power_w": 612.3, "temp_c": 58.0,
                             "reasons": "0x0000000000000004"}
    assert gpus.clocks(1)["reasons"] == "0x0000000000000001" and gpus.clocks(2) is None


def test_clocks_on_a_driver_without_event_reasons_and_on_none(tmp_path, monkeypatch):
    """A driver that refuses the event-reasons field still gives clocks, power and
    temperature; a field it cannot read, or no nvidia-smi, gives None."""
    older = ('#!/bin/sh\ncase "$*" in *clocks_event_reasons*) exit 2 ;; esac\n'
             "printf '1410, 300.5, 45\\n'\n")
    monkeypatch.setenv("PATH", _path_with(tmp_path / "a", older))
    assert gpus.clocks() == {"sm_mhz": 1410.0, "power_w": 300.5, "temp_c": 45.0}
    monkeypatch.setenv("PATH", _path_with(tmp_path / "b",
                                          "#!/bin/sh\nprintf '[N/A], 1, 2, 0x0\\n'\n"))
    assert gpus.clocks() is None
    monkeypatch.setenv("PATH", _path_with(tmp_path / "c", None))
    assert gpus.clocks() is None
