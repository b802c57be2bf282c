"""The host sampler (`speclab.hostwatch`): /proc parsing, a busy process seen in the window it
ran and not after it, and each pass set beside the samples of its greedy window."""

import subprocess
import sys
import time

import pytest

from speclab import hostwatch as H
from speclab import store

STAT = "cpu  {} 0 {} {} {} 0 0 {} 0 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n"


def _stat(user, system, idle, iowait, steal):
    return H.parse_stat(STAT.format(user, system, idle, iowait, steal))


def test_proc_files_are_read_by_field():
    assert _stat(10, 20, 30, 40, 50) == {"user": 10, "nice": 0, "system": 20, "idle": 30,
                                        "iowait": 40, "irq": 0, "softirq": 0, "steal": 50}
    with pytest.raises(ValueError):
        H.parse_stat("intr 1 2 3\n")
    # a command with spaces and parentheses: the fields are counted after its last ')'
    fields = ["S"] + [str(i) for i in range(4, 14)] + ["700", "300"] + ["0"] * 23 + ["5"]
    assert H.parse_pid_stat(f"42 (VLLM::Engine (x)) {' '.join(fields)}") == (
        "VLLM::Engine (x)", 1000, 5)


def test_a_sample_counts_cores_by_kind_and_drops_a_reused_pid():
    before = (100.0, _stat(0, 0, 0, 0, 0), {1: ("engine", 0, 0), 2: ("old", 0, 1)})
    after = (102.0, _stat(200, 100, 300, 20, 50),
             {1: ("engine", 180, 3), 2: ("new", 150, 1), 3: ("born", 90, 2)})
    s = H.delta(before, after, tick_hz=100)
    assert (s["busy"], s["iowait"], s["steal"], s["dt"]) == (1.5, 0.1, 0.25, 2.0)
    # pid 2 is another command now and pid 3 has no earlier reading: neither is counted
    assert s["top"] == [[1, "engine", 0.9, 3]]


def test_a_busy_process_shows_in_its_window_and_not_after(tmp_path):
    path = tmp_path / "host.jsonl"
    watch = H.Watch(path, interval=0.25).start()
    t0 = time.time()
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"])
    child.wait()
    t1 = time.time()
    time.sleep(1.5)
    watch.stop()
    rows = store.read_jsonl(path)
    assert len(rows) >= 10
    seen = [c for r in rows for c in r["top"] if c[0] == child.pid]
    assert seen and max(c[2] for c in seen) > 0.7
    spin, after = H.per_pass(rows, [
        {"engine": "e", "op": "pass", "round": 1, "B": 1, "k": 3, "t_full_start": t0 + 0.3,
         "t_full_s": t1 - t0 - 0.6},
        {"engine": "e", "op": "pass", "round": 2, "B": 1, "k": 3, "t_full_start": t1 + 0.5,
         "t_full_s": 0.8}])
    assert spin["busy"] > 0.7 and "python" in spin["top"]
    assert after["busy"] < spin["busy"] - 0.5  # the control: the same machine, the child gone
    assert spin["covered_s"] == pytest.approx(t1 - t0 - 0.6, abs=0.05)


def test_a_pass_takes_the_samples_it_overlaps_weighted_by_the_overlap():
    host = [{"t": 11.0, "dt": 1.0, "busy": 1.0, "iowait": 0.0, "steal": 0.0, "load1": 1.0,
             "top": [[7, "drafter", 1.0, 0]]},
            {"t": 12.0, "dt": 1.0, "busy": 3.0, "iowait": 0.0, "steal": 1.0, "load1": 1.0,
             "top": [[8, "neighbour", 2.0, 1], [7, "drafter", 1.0, 0]]}]
    rows = [{"engine": "e", "op": "pass", "round": 1, "B": 1, "k": 3, "t_full_start": 10.5,
             "t_full_s": 1.0},  # half of each sample's interval
            {"engine": "e", "op": "pass", "round": 2, "B": 1, "k": 3, "t_full_start": 20.0,
             "t_full_s": 1.0},  # no sample
            {"engine": "e", "op": "split", "round": 0, "B": 1, "k": 3, "t_full_s": 1.0}]
    (row,) = H.per_pass(host, rows)
    assert (row["busy"], row["steal"], row["covered_s"]) == (2.0, 0.5, 1.0)
    assert row["top"] == "drafter 1.00, neighbour 1.00"


def test_the_gpu_is_sampled_where_there_is_one_and_read_per_pass(tmp_path, monkeypatch):
    """With a GPU (a stand-in nvidia-smi on PATH) each sample carries its clock, power and
    temperature, and a pass reads their mean and every non-zero clock-event reason over its
    window; without one (the control) samples and passes have no GPU fields."""
    from test_gpus import SMI, _path_with

    monkeypatch.setenv("PATH", _path_with(tmp_path / "gpu", SMI))
    watch = H.Watch(tmp_path / "host.jsonl", interval=0.2).start()
    time.sleep(0.7)
    watch.stop()
    rows = store.read_jsonl(tmp_path / "host.jsonl")
    assert rows and all(r["gpu"]["sm_mhz"] == 1755.0 for r in rows)
    host = [{"t": t, "dt": 1.0, "busy": 1.0, "iowait": 0.0, "steal": 0.0, "load1": 1.0,
             "top": [], "gpu": {"sm_mhz": mhz, "power_w": 700.0, "temp_c": 60.0,
                                "reasons": reasons}}
            for t, mhz, reasons in ((11.0, 1980.0, "0x0000000000000000"),
                                    (12.0, 1500.0, "0x0000000000000004"))]
    pas = {"engine": "e", "op": "pass", "round": 1, "B": 16, "k": 3, "t_full_start": 10.0,
           "t_full_s": 2.0}
    (row,) = H.per_pass(host, [pas])
    assert row["sm_mhz"] == 1740.0 and row["clock_events"] == "0x0000000000000004"
    (cpu_only,) = H.per_pass([{k: v for k, v in h.items() if k != "gpu"} for h in host], [pas])
    assert "sm_mhz" not in cpu_only and "clock_events" not in cpu_only
    monkeypatch.setenv("PATH", _path_with(tmp_path / "none", None))
    watch = H.Watch(tmp_path / "cpu.jsonl", interval=0.2).start()
    time.sleep(0.5)
    watch.stop()
    assert not any("gpu" in r for r in store.read_jsonl(tmp_path / "cpu.jsonl"))
