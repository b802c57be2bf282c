import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from speclab import plots  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    """Each test's figures are closed after it (pyplot keeps every figure it made)."""
    yield
    plt.close("all")


def test_al_and_speed_vs_k_is_not_drawn_for_a_plain_only_run(capsys):
    # a parity run whose grid is k=0 only: no acceptance rows, two plain throughputs
    speed = pd.DataFrame({"point_id": ["a", "b"], "k": [0, 0], "layout": ["tp1", "tp1"],
                          "kv_cache_dtype": ["fp8", "fp8_e4m3"], "prompt_format": ["raw"] * 2,
                          "throughput_tok_s": [100.0, 110.0], "baseline_tok_s": [100.0, 110.0],
                          "mean_acceptance_length": [float("nan")] * 2})
    assert plots.al_and_speed_vs_k(pd.DataFrame(), speed, 0.1, title="t") is None
    assert "not drawn" in capsys.readouterr().out


def _acc(dkvs=("auto", "fp8")):
    rows = []
    for dkv in dkvs:
        for k in (1, 2):
            rows.append({"point_id": f"k{k}_kv-fp8_dkv-{dkv}_tp1_raw", "k": k, "layout": "tp1",
                         "kv_cache_dtype": "fp8", "draft_kv_cache_dtype": dkv,
                         "prompt_format": "raw", "n_requests": 16,
                         "mean_acceptance_length": 1.5 * k, "al_lo": 1.4 * k, "al_hi": 1.6 * k})
    return pd.DataFrame(rows)


def _texts(fig) -> str:
    return " ".join(t.get_text() for t in fig.texts)


def test_identical_series_stay_distinguishable_and_error_bars_are_described():
    acc = _acc()  # two draft KV dtypes with identical AL (as under fp8 KV on the H200)
    speed = acc.assign(throughput_tok_s=10.0, baseline_tok_s=5.0, speedup=2.0)
    fig = plots.al_and_speed_vs_k(acc, speed, 0.1, title="t")
    ax_al = fig.axes[0]
    series = [c for c in ax_al.containers]
    xs = [tuple(c.lines[0].get_xdata()) for c in series]
    assert len(set(xs)) == 2, "coinciding series are drawn apart"
    assert {c.lines[0].get_marker() for c in series} == {"o", "s"}
    labels = [t.get_text() for t in ax_al.get_legend().get_texts()]
    assert "draft KV auto" in labels and "draft KV fp8" in labels
    assert "95% percentile bootstrap CI over requests (N = 16" in _texts(fig)


def test_save_stamps_the_run_caption(tmp_path):
    fig = plots.per_position(pd.DataFrame([
        {"point_id": "k1_a", "k": 1, "position": 0, "unconditional": 0.7, "u_lo": 0.6,
         "u_hi": 0.8, "conditional": 0.7, "c_lo": 0.6, "c_hi": 0.8, "n_requests": 8}]), "t")
    plots.save(fig, tmp_path, "pp", "run r1 · measured 2026-11-30 · vLLM 0.22.0 · NVIDIA H200")
    svg = (tmp_path / "pp.svg").read_text()
    assert "vLLM 0.22.0" in svg and "N = 8" in svg
    assert plots.save(None, tmp_path, "none") is None and not (tmp_path / "none.png").exists()
    assert plt.fignum_exists(fig.number)  # a notebook's figure stays open to be shown
    plots.save(fig, tmp_path, "pp2", close=True)  # a script's is closed once written
    assert (tmp_path / "pp2.png").exists() and not plt.fignum_exists(fig.number)


def test_histogram_legend_is_unique_with_integer_ticks():
    hist = pd.DataFrame([{"point_id": pid, "k": k, "length": n, "steps": 10, "fraction": 0.5}
                         for pid, k in [("k1_kv-fp8_dkv-auto_tp1_raw", 1),
                                        ("k1_kv-fp8_dkv-fp8_tp1_raw", 1)]
                         for n in (1, 2)])
    fig = plots.acceptance_histogram(hist, "t")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(set(labels)) == len(labels) == 2
    assert labels[0].startswith("k1 dkv-auto")
    assert list(ax.get_xticks()) == [1, 2]


def test_parity_margin_axis_has_units():
    summary = pd.DataFrame([{"arm": "spec", "status": "ok", "match_rate": 0.5, "match_lo": 0.2,
                             "match_hi": 0.8, "noise_floor": 0.0, "n": 2}])
    cmp = pd.DataFrame([{"arm": "spec", "exact": False, "first_divergence": 3, "margin": 0.01,
                         "kind": "near-tie"}, {"arm": "spec", "exact": True,
                                               "first_divergence": None, "margin": None,
                                               "kind": None}])
    fig = plots.parity_overview(summary, cmp, 0.05, "t")
    assert "(nats)" in fig.axes[2].get_xlabel()
    assert "Wilson 95% CI over prompts (N = 2" in _texts(fig)


def test_a_figure_saved_again_has_the_same_bytes(tmp_path):
    """Re-rendering a committed report must not churn its SVGs (matplotlib's random ids)."""
    df = pd.DataFrame([{"point_id": "k1_a", "k": 1, "position": 0, "unconditional": 0.7,
                        "u_lo": 0.6, "u_hi": 0.8, "conditional": 0.7, "c_lo": 0.6,
                        "c_hi": 0.8, "n_requests": 8}])
    for out in ("a", "b"):
        plots.save(plots.per_position(df, "t"), tmp_path / out, "pp")
    assert (tmp_path / "a/pp.svg").read_bytes() == (tmp_path / "b/pp.svg").read_bytes()


def test_speedup_vs_k_draws_only_configurations_with_a_plain_engine(capsys):
    """A configuration without a plain engine beside it has no speedup: no empty panel for
    it; with none left, no figure, and the reason printed."""
    row = {"layers": 32, "eager": False, "draft": "", "B": 1, "k": 3, "speedup": 1.4,
           "speedup_lo": 1.3, "speedup_hi": 1.5}
    lone = {**row, "layers": 4, "speedup": float("nan"), "speedup_lo": float("nan"),
            "speedup_hi": float("nan")}
    fig = plots.speedup_vs_k(pd.DataFrame([row, lone]))
    assert [ax.get_title() for ax in fig.axes] == ["32 layers, CUDA graphs"]
    assert plots.speedup_vs_k(pd.DataFrame([lone])) is None
    assert "no speculative point with a plain engine" in capsys.readouterr().out
