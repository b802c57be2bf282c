import json
import subprocess
import sys

import pytest
from profile_files import write

from speclab import preflight, profiles, sweep
from speclab.profiles import ProfileError


@pytest.mark.parametrize("name", profiles.available())
def test_shipped_profiles_are_valid(name):
    prof = profiles.load(name)
    assert sweep.expand(prof)
    if prof.backend == "cuda":  # eager GPU runs JIT-compile per decode batch size (H200 logs)
        assert prof.warmup_tokens == prof.max_tokens


@pytest.mark.parametrize("data, message", [
    ({"grid": {"num_speculative_tokens": [-1, 2]}}, "k >= 0"),
    ({"grid": {"layout": [{"tp": 2, "dp": 2}]}}, "server mode"),
    ({"grid": {"layout": [{"tp": 0}]}}, "grid.layout.0.tp"),
    ({"draft": None}, "no draft model"),
    ({"engine": {"kv_cache_dtype": "fp8"}}, "set by the grid"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"warmup_tokens": 0}, "warmup_tokens"),
    ({"bogus": 1}, "bogus"),
    ({"backend": "tpu"}, "backend"),
])
def test_static_validation_errors_are_one_clear_line_each(tmp_path, data, message):
    with pytest.raises(ProfileError) as e:
        profiles.load(write(tmp_path, **data))
    assert message in str(e.value)
    assert "Traceback" not in str(e.value)


@pytest.mark.parametrize("axis", ["num_speculative_tokens", "kv_cache_dtype",
                                  "draft_kv_cache_dtype", "layout", "prompt_format"])
def test_an_empty_grid_axis_is_refused_by_name(tmp_path, axis):
    with pytest.raises(ProfileError) as e:
        profiles.load(write(tmp_path, grid={axis: []}))
    assert str(e.value) == f"t.yaml: grid.{axis}: empty; give at least one value"


def test_a_bad_override_is_blamed_on_the_override(tmp_path):
    with pytest.raises(ProfileError) as e:
        profiles.load(write(tmp_path), {"max_tokens": 0, "grid": {"layout": [{"tp": 0}]}})
    assert str(e.value).splitlines() == [
        "overrides: max_tokens: Input should be greater than or equal to 1",
        "overrides: grid.layout.0.tp: Input should be greater than or equal to 1"]


def test_unknown_profile_lists_available():
    with pytest.raises(ProfileError, match="available: .*tiny-cpu"):
        profiles.load("no-such-profile")


def test_profiles_hold_inputs_and_preflight_the_machine_checks():
    machine = {"check_env", "installed_vllm", "vllm_kv_dtypes", "numa_nodes",
               "engine_arg_names", "engine_key_problems"}
    assert not machine & set(vars(profiles)) and machine <= set(vars(preflight))


def test_profile_check_prints_what_stops_a_point_and_fails_when_strict(tmp_path, capsys):
    from speclab import cli

    path = write(tmp_path, backend="cuda", grid={"layout": [{"tp": 4}]})
    assert cli.main(["profile", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  not runnable here: needs 4 GPUs" in out and "p.jsonl does not exist" in out
    assert cli.main(["profile", "check", str(path), "--strict"]) == 1


def test_environment_checks(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    prof = profiles.load(write(tmp_path, backend="cuda",
                               grid={"kv_cache_dtype": ["fp9"], "layout": [{"tp": 4, "ep": True}]}))
    problems = "\n".join(preflight.check_env(prof))
    assert "'fp9' is not a KV dtype of vLLM" in problems
    assert "needs 4 GPUs" in problems
    assert "p.jsonl does not exist" in problems
    missing = profiles.load(write(tmp_path, target="/nonexistent/model", draft="org/not-cached"))
    problems = "\n".join(preflight.check_env(missing))
    assert "/nonexistent/model: no such file" in problems
    assert "org/not-cached: not in the local Hugging Face cache" in problems


@pytest.mark.vllm
def test_kv_dtypes_read_from_vllms_source_are_its_literal():
    from typing import get_args

    from vllm.config.cache import CacheDType

    preflight.vllm_kv_dtypes.cache_clear()
    assert preflight.vllm_kv_dtypes() == get_args(CacheDType) and "fp8_e4m3" in get_args(CacheDType)


def test_expand_dedupes_draft_dtype_for_plain_points():
    prof = profiles.load("v4flash-4xb200")
    ids = [p.id for p in sweep.expand(prof)]
    assert len(ids) == len(set(ids)) == 1 + 5 * 2 + 3  # eagle3 k1-5 x draft KV, mtp k1-3
    assert "k0_kv-fp8_tp4-ep_chat" in ids and "k3_kv-fp8_dkv-auto_tp4-ep_chat" in ids
    assert "k3_mtp_kv-fp8_tp4-ep_chat" in ids


def test_profile_check_prints_engine_args_without_loading_models():
    out = subprocess.run([sys.executable, "-m", "speclab", "profile", "check", "v4flash-4xb200"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "profile v4flash-4xb200: valid" in out.stdout
    line = next(l for l in out.stdout.splitlines() if "k3_kv-fp8_dkv-auto" in l)
    args = json.loads(out.stdout.split(line, 1)[1].split("LLM(**", 1)[1].split(")\n", 1)[0])
    assert args["tensor_parallel_size"] == 4 and args["enable_expert_parallel"] is True
    assert args["speculative_config"] == {"method": "eagle3", "num_speculative_tokens": 3,
                                          "model": "ManiacLabs/DeepSeek-V4-Flash-EAGLE3.1",
                                          "kv_cache_dtype": "auto"}
    assert args["gpu_memory_utilization"] == 0.6 and args["max_model_len"] == 8192
    # chat prompts through vLLM's own DeepSeek-V4 encoding (vllm/tokenizers/deepseek_v4.py)
    assert args["tokenizer_mode"] == "deepseek_v4"
    assert "needs 4 GPUs" in out.stdout
    strict = subprocess.run([sys.executable, "-m", "speclab", "profile", "check", "v4flash-4xb200",
                             "--strict"], capture_output=True, text=True)
    assert strict.returncode == 1


def test_cli_reports_bad_profile_as_one_line_error(tmp_path):
    bad = write(tmp_path, grid={"num_speculative_tokens": [-2]})
    out = subprocess.run([sys.executable, "-m", "speclab", "profile", "check", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.startswith("speclab: error:") and "Traceback" not in out.stderr


def test_engine_args_take_the_gpu_share_lab_py_gives_a_job(monkeypatch):
    from speclab import engine

    prof = profiles.load("tiny-dsv4-h200")
    point = next(p for p in sweep.expand(prof) if p.k == 3)
    args, _ = engine.engine_args(prof, point, "t", "d")
    assert args["gpu_memory_utilization"] == 0.4 and "kv_cache_memory_bytes" not in args
    monkeypatch.setenv(engine.GPU_UTIL_ENV, "0.3")
    monkeypatch.setenv(engine.KV_BYTES_ENV, str(4 * 2**30))
    args, _ = engine.engine_args(prof, point, "t", "d")
    assert args["gpu_memory_utilization"] == 0.3 and args["kv_cache_memory_bytes"] == 4 * 2**30
    monkeypatch.setenv(engine.GPU_UTIL_ENV, "0.5")  # a cap, never a raise
    assert engine.engine_args(prof, point, "t", "d")[0]["gpu_memory_utilization"] == 0.4


@pytest.mark.parametrize("env, message", [
    ({"SPECLAB_GPU_MEMORY_UTILIZATION": "1.5"}, "want a fraction"),
    ({"SPECLAB_KV_CACHE_MEMORY_BYTES": "0"}, "want a positive byte count"),
])
def test_gpu_share_refuses_bad_values(env, message):
    from speclab import engine

    with pytest.raises(ValueError, match=message):
        engine.gpu_share({"gpu_memory_utilization": 0.4}, env)
