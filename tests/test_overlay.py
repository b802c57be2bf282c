"""The overlay's packaging and plan, without importing vLLM: install/uninstall of the ``.pth``,
start-up safety, the per-feature plan decided from the classes (refusals, ``off``, ``force``)
and hook failures (on small stand-in ``vllm`` trees that reproduce the module layout the
hooks target), and ``speclab.overlay.status`` (on the real 0.22.0 tree, read statically)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from vllm022 import vllm022_tree  # noqa: F401  (session fixture)

from speclab import overlay, vllm_matrix

OVERLAY = Path(__file__).resolve().parents[1] / "overlay"


def run(code: str, *, path=(), env=None, flags=()) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with ``path`` on PYTHONPATH (-S: no site dirs)."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "DSV4_EAGLE3_OVERLAY",
                             "EAGLE3_DRAFT_KV_CACHE_DTYPE")}
    full_env.update(env or {}, PYTHONPATH=os.pathsep.join(map(str, path)))
    return subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)], check=False,
                          capture_output=True, text=True, env=full_env, timeout=120)


STOCK_022_FORWARD = '''
    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
        # the calls of vLLM 0.22's DeepseekV4Model.forward; run here, it returns "stock"
        if input_ids == "never":
            hidden_states = self.embed_input_ids(get_pp_group())
            hidden_states.unsqueeze(-2).repeat(1, self.hc_mult, 1)
            input_ids.to(0)
            for layer in islice(self.layers, 0, 1):
                layer()
                layer.hc_post(current_platform.is_cuda())
            self._mtp_hidden_buffer[:num_tokens].copy_(hidden_states.flatten(1))
            IntermediateTensors(self.norm(self.hc_head_op()))
        return "stock"
'''
NATIVE_FORWARD = '''
    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
        for idx in range(3):
            if idx + 1 in self.aux_hidden_state_layers:
                return "native"
        return "stock"
'''
OTHER_FORWARD = '''
    def forward(self, input_ids, positions, intermediate_tensors, inputs_embeds=None):
        return self.something_else(input_ids)
'''


def fake_vllm(root: Path, version: str, forward: str = STOCK_022_FORWARD, native: bool = False,
              kv_utils: bool = False) -> Path:
    """A stand-in ``vllm`` package: version module, the interfaces the hook uses and a
    DeepSeek-V4 model module whose classes look like 0.22's to the overlay's plan (the same
    calls in ``DeepseekV4Model.forward``, ``hc_post`` on the layer), or native ones."""
    model_base, causal_base = ("EagleModelMixin", "SupportsEagle3") if native else (
        "object", "object")
    body = textwrap.indent(textwrap.dedent(forward), "    ")
    files = {
        "__init__.py": "from .version import __version__\n",
        "version.py": f"__version__ = {version!r}\n",
        "model_executor/__init__.py": "",
        "model_executor/models/__init__.py": "",
        "model_executor/models/interfaces.py": """
            class EagleModelMixin:
                aux_hidden_state_layers = ()


            class SupportsEagle3:
                supports_eagle3 = True
                has_own_lm_head = False
                has_own_embed_tokens = False

                def set_aux_hidden_state_layers(self, layers):
                    self.model.aux_hidden_state_layers = tuple(layers)

                def get_eagle3_default_aux_hidden_state_layers(self):
                    n = len(self.model.layers)
                    return (2, n // 2, n - 3)


            def supports_eagle3(model):
                return all(hasattr(model, m) for m in (
                    "supports_eagle3", "has_own_lm_head", "has_own_embed_tokens",
                    "set_aux_hidden_state_layers",
                    "get_eagle3_default_aux_hidden_state_layers"))
            """,
        "models/__init__.py": "",
        "models/deepseek_v4/__init__.py": "from .nvidia.model import DeepseekV4ForCausalLM\n",
        "models/deepseek_v4/nvidia/__init__.py": "",
        "models/deepseek_v4/nvidia/model.py": textwrap.dedent("""
            from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3


            def get_pp_group():
                raise AssertionError("no distributed group in this stand-in")


            class IntermediateTensors(dict):
                pass


            class DeepseekV4DecoderLayer:
                def hc_post(self, x, residual, post_mix, res_mix):
                    return x


            class DeepseekV4ForCausalLM(%s):
                pass


            class DeepseekV4Model(%s):
            """) % (causal_base, model_base) + body,
    }
    if kv_utils:  # present but without the functions the overlay wraps
        files |= {"v1/__init__.py": "", "v1/core/__init__.py": "",
                  "v1/kv_cache_interface.py": "", "v1/core/kv_cache_utils.py": "X = 1\n"}
    for rel, text in files.items():
        path = root / "vllm" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


REPORT = """
    import json, sys
    import deepseek_v4_eagle3_aux as aux
    aux.install()
    import vllm.models.deepseek_v4 as pkg
    from vllm.models.deepseek_v4.nvidia import model
    print(json.dumps({
        "status": {k: v["status"] for k, v in aux.PATCHES.items()},
        "plan": {k: v["action"] for k, v in aux.base.PLAN.get("nvidia", {}).items()},
        "detail": {k: v["detail"] for k, v in aux.base.PLAN.get("nvidia", {}).items()},
        "forward_is_overlay": model.DeepseekV4Model.forward is aux.forward,
        "supports_eagle3": getattr(model.DeepseekV4ForCausalLM, "supports_eagle3", False),
        "heavy": [m for m in ("torch", "transformers") if m in sys.modules],
    }))
"""


def gate(tmp_path, version, env=None, code=REPORT, **kw):
    tree = fake_vllm(tmp_path / version, version, **kw)
    done = run(code, path=[tree, OVERLAY], env=env, flags=["-S"])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


APPLIED = {"eagle3-interface": "applied", "aux-forward": "applied", "id-convention": "applied"}


# --------------------------------------------------------------------------- the plan in-process
def test_a_forward_that_fits_is_patched_whatever_the_version(tmp_path):
    for version in ("0.22.0", "0.99.0"):  # decided from the classes, not the version string
        out, err = gate(tmp_path, version)
        assert out["status"] == APPLIED and out["plan"] == dict.fromkeys(
            ["interface", "aux-forward", "id-convention"], "patched")
        assert out["forward_is_overlay"] and out["supports_eagle3"] is True
        assert out["heavy"] == [] and "Warning" not in err


def test_native_classes_only_get_the_id_mapping(tmp_path):
    out, err = gate(tmp_path, "0.33.0", forward=NATIVE_FORWARD, native=True)
    assert out["plan"] == {"interface": "native", "aux-forward": "native",
                           "id-convention": "patched"}
    assert out["status"] == {"id-convention": "applied"}
    assert "SupportsEagle3" in out["detail"]["interface"]
    assert not out["forward_is_overlay"] and "Warning" not in err


def test_a_forward_that_does_not_fit_is_refused_naming_feature_release_and_fix(tmp_path):
    out, err = gate(tmp_path, "0.22.0", forward=OTHER_FORWARD)
    assert set(out["plan"].values()) == {"refused"} and out["status"] == {}
    assert not out["forward_is_overlay"] and out["supports_eagle3"] is False
    for feature in ("interface", "aux-forward", "id-convention"):
        assert f"{feature} refused on vLLM 0.22.0 (nvidia)" in err
    assert "RuntimeWarning" in err and "use vLLM 0.21-0.24 with this overlay" in err


def test_force_cannot_apply_a_body_that_does_not_fit(tmp_path):
    out, err = gate(tmp_path, "0.25.0", forward=OTHER_FORWARD,
                    env={"DSV4_EAGLE3_OVERLAY": "force"})
    assert set(out["plan"].values()) == {"refused"} and out["status"] == {}
    assert not out["forward_is_overlay"] and "refused" in err


def test_off_disables_everything(tmp_path):
    out, err = gate(tmp_path, "0.22.0", env={"DSV4_EAGLE3_OVERLAY": "off"})
    assert set(out["status"].values()) == {"off"} and not out["forward_is_overlay"]
    assert "Warning" not in err


def test_install_after_import_patches_at_once(tmp_path):
    code = """
        import json
        import vllm.models.deepseek_v4.nvidia.model as model
        import deepseek_v4_eagle3_aux as aux
        aux.install(); aux.install()
        print(json.dumps({"forward_is_overlay": model.DeepseekV4Model.forward is aux.forward,
                          "status": {k: v["status"] for k, v in aux.PATCHES.items()}}))
    """
    out, _ = gate(tmp_path, "0.22.0", code=code)
    assert out == {"forward_is_overlay": True, "status": APPLIED}


def test_failing_patches_warn_and_never_break_the_import(tmp_path):
    tree = fake_vllm(tmp_path / "t", "0.22.0", kv_utils=True)
    (tree / "vllm/models/deepseek_v4/__init__.py").write_text("")
    (tree / "vllm/models/deepseek_v4/nvidia/model.py").write_text("X = 2\n")  # no classes
    code = """
        import json
        import deepseek_v4_eagle3_aux as aux
        aux.install()
        import vllm.v1.core.kv_cache_utils as kvu   # lacks the functions the overlay wraps
        import vllm.models.deepseek_v4.nvidia.model as model
        print(json.dumps({k: v["status"] for k, v in aux.PATCHES.items()}
                         | {"kv": aux.base.PLAN["engine"]["kv-grouping"]["action"],
                            "imported": kvu.X + model.X}))
    """
    done = run(code, path=[tree, OVERLAY], flags=["-S"])
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out == {"kv": "refused", "patch_model": "failed", "imported": 3}
    assert "kv-grouping refused on vLLM 0.22.0" in done.stderr
    assert "AttributeError" in done.stderr


# --------------------------------------------------------------------------- install / .pth
SITE_PROBE = """
    import json, site, sys
    site.addsitedir(sys.argv[1] if len(sys.argv) > 1 else {site!r})
    mod = sys.modules.get("eagle3_draft_kv_cache")
    print(json.dumps({{"installed": bool(mod and mod.installed()),
                      "heavy": [m for m in ("torch", "vllm") if m in sys.modules]}}))
"""


def addsitedir(site: Path) -> subprocess.CompletedProcess:
    return run(SITE_PROBE.format(site=str(site)), flags=["-S"])


def test_install_is_idempotent_and_processed_by_site(tmp_path):
    site = tmp_path / "site"
    pth = overlay.install(site)
    assert pth == site / overlay.PTH_NAME and pth.read_text() == overlay.PTH_TEXT
    folder = site / overlay.DIR_NAME
    for name in overlay.FILES:
        assert (folder / name).read_bytes() == (OVERLAY / name).read_bytes()
    stamps = {p: p.stat().st_mtime_ns for p in [pth, *folder.iterdir()]}
    assert overlay.install(site) == pth
    assert {p: p.stat().st_mtime_ns for p in [pth, *folder.iterdir()]} == stamps

    done = addsitedir(site)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert json.loads(done.stdout) == {"installed": True, "heavy": []}

    moved = shutil.copytree(site, tmp_path / "elsewhere")  # the .pth holds no absolute path
    assert json.loads(addsitedir(moved).stdout)["installed"]


def test_uninstall_removes_exactly_what_install_wrote(tmp_path):
    site = tmp_path / "site"
    (site / "other.pth").parent.mkdir(parents=True)
    (site / "other.pth").write_text("")
    overlay.install(site)
    assert addsitedir(site).returncode == 0  # leaves __pycache__ behind in the overlay folder
    removed = overlay.uninstall(site)
    assert site / overlay.PTH_NAME in removed and site / overlay.DIR_NAME in removed
    assert sorted(p.name for p in site.iterdir()) == ["other.pth"]
    assert overlay.uninstall(site) == []


@pytest.mark.parametrize("damage", ["syntax error", "missing file"])
def test_broken_overlay_never_breaks_startup(tmp_path, damage):
    site = tmp_path / "site"
    overlay.install(site)
    aux = site / overlay.DIR_NAME / "deepseek_v4_eagle3_aux.py"
    if damage == "syntax error":
        aux.write_text("def broken(:\n")
    else:
        aux.unlink()
    done = addsitedir(site)
    assert done.returncode == 0
    assert json.loads(done.stdout)["installed"] is False
    assert "DeepSeek-V4 EAGLE-3 overlay not loaded" in done.stderr
    assert ("SyntaxError" if damage == "syntax error" else "No module named") in done.stderr


# --------------------------------------------------------------------------- status
STATUS = """
    import json, sys
    from speclab import overlay, vllm_matrix
    st = overlay.status(site={site!r}, probe={probe})
    text = overlay.format_status(st)
    print(json.dumps(st | {{"text": text, "heavy": [m for m in ("torch", "vllm")
                                                     if m in sys.modules]}}))
"""


def status_in(tmp_path, tree, site, probe=False, env=None):
    src = Path(overlay.__file__).resolve().parents[1]
    done = run(STATUS.format(site=str(site), probe=probe), path=[tree, src], env=env,
               flags=["-S"])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_status_of_real_vllm_022_before_and_after_install(tmp_path, vllm022_tree):  # noqa: F811
    """The plan of the real 0.22.0 tree, read without importing it, as the matrix has it."""
    site = tmp_path / "site"
    site.mkdir()
    st = status_in(tmp_path, vllm022_tree, site)
    assert st["vllm"]["version"] == "0.22.0" and st["support"] == "none"
    assert "not installed" in st["support_detail"] and st["pth"] == []
    assert st["heavy"] == [] and st["patches_source"] == "plan"
    assert st["plan"] == vllm_matrix.load()["releases"]["0.22.0"]["plan"]
    assert "not patched:    everything" in st["text"]

    overlay.install(site)
    st = status_in(tmp_path, vllm022_tree, site, env={"EAGLE3_DRAFT_KV_CACHE_DTYPE": "fp8"})
    assert st["support"] == "overlay" and st["pth"] == [str(site / overlay.PTH_NAME)]
    assert st["overlay_dir"] == str(site / overlay.DIR_NAME)
    assert st["draft_kv_cache_dtype"] == {"value": "fp8", "source": "EAGLE3_DRAFT_KV_CACHE_DTYPE"}
    assert {p["status"] for p in st["patches"].values()} == {"planned"}
    assert {"kv-groups", "kv-tensors", "draft-cache-config",
            "aux-forward (nvidia)"} <= set(st["patches"])
    assert len(st["not_patched"]) == 3 and all(
        g.startswith("amd ") and "0.26.0" in g for g in st["not_patched"])
    for line in ("interface       patched  refused", "kv-grouping     patched (engine-wide)",
                 "amd interface: DeepseekV4Model.forward calls what no overlay forward"):
        assert line in st["text"]


def test_status_probe_lists_what_was_applied(tmp_path):
    tree = fake_vllm(tmp_path / "v", "0.22.0")
    site = tmp_path / "site"
    overlay.install(site)
    st = status_in(tmp_path, tree, site, probe=True)
    assert st["patches_source"] == "probe"
    assert st["patches"]["aux-forward"]["status"] == "applied"


def test_status_of_native_classes(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    st = status_in(tmp_path, fake_vllm(tmp_path / "n", "0.33.0", forward=NATIVE_FORWARD,
                                       native=True), site)
    assert st["support"] == "none" and "not installed" in st["support_detail"]
    assert {f: e["action"] for f, e in st["plan"]["platforms"]["nvidia"].items()} == {
        "interface": "native", "aux-forward": "native", "id-convention": "patched"}


def test_status_warns_when_vllm_is_newer_than_the_matrix(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    newer = status_in(tmp_path, fake_vllm(tmp_path / "new", "0.35.0", forward=NATIVE_FORWARD,
                                          native=True), site)
    assert newer["horizon"] == vllm_matrix.horizon("0.35.0")
    assert "run tools/vllm_matrix.py 0.35.0" in newer["horizon"]
    assert f"warning         {newer['horizon']}" in newer["text"]
    known = status_in(tmp_path, fake_vllm(tmp_path / "known", vllm_matrix.RELEASES[-1],
                                          forward=NATIVE_FORWARD, native=True), site)
    assert known["horizon"] is None and "warning" not in known["text"]


# --------------------------------------------------------------------------- overlay plan (CLI)
EAGLE31_DRAFT = {"architectures": ["LlamaForCausalLMEagle3"],
                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 21, 40]}}


def test_overlay_plan_prints_the_resolution_without_vllm(tmp_path, capsys, monkeypatch):
    from speclab import cli

    monkeypatch.delenv("EAGLE3_AUX_LAYER_CONVENTION", raising=False)
    draft, target = tmp_path / "draft", tmp_path / "target"
    draft.mkdir(), target.mkdir()
    (draft / "config.json").write_text(json.dumps(EAGLE31_DRAFT))
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 43}))
    assert cli.main(["overlay", "plan", "--draft-config", str(draft),
                     "--target-config", str(target)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["convention"], out["config_ids"], out["capture_after_layers"],
            out["num_layers"]) == ("output", [1, 21, 40], [2, 22, 41], 43)
    assert "first id is 1" in out["why"]

    assert cli.main(["overlay", "plan", "--draft-config", str(draft / "config.json")]) == 0
    assert json.loads(capsys.readouterr().out)["num_layers"] is None  # range unchecked
    monkeypatch.setenv("EAGLE3_AUX_LAYER_CONVENTION", "input")
    assert cli.main(["overlay", "plan", "--draft-config", str(draft), "--num-layers", "43"]) == 0
    assert json.loads(capsys.readouterr().out)["capture_after_layers"] == [1, 21, 40]


@pytest.mark.parametrize("args,message", [
    ([], "needs --draft-config"),
    (["--draft-config", "missing"], "no config.json"),
    (["--draft-config", "DRAFT", "--num-layers", "40"], "[41] not in 1..40"),
])
def test_overlay_plan_bad_input_fails_clearly(tmp_path, capsys, monkeypatch, args, message):
    from speclab import cli

    monkeypatch.delenv("EAGLE3_AUX_LAYER_CONVENTION", raising=False)
    (tmp_path / "config.json").write_text(json.dumps(EAGLE31_DRAFT))
    args = [str(tmp_path) if a == "DRAFT" else str(tmp_path / a) if a == "missing" else a
            for a in args]
    assert cli.main(["overlay", "plan", *args]) == 2
    assert message in capsys.readouterr().err
