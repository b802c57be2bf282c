import matplotlib

matplotlib.use("Agg")
import pandas as pd  # noqa: E402

from speclab import plots  # noqa: E402


def test_al_and_speed_vs_k_draws_a_plain_only_run():
    # a parity run whose grid is k=0 only: no acceptance rows, two plain throughputs
    speed = pd.DataFrame({"point_id": ["a", "b"], "k": [0, 0], "layout": ["tp1", "tp1"],
                          "kv_cache_dtype": ["fp8", "fp8_e4m3"], "prompt_format": ["raw"] * 2,
                          "throughput_tok_s": [100.0, 110.0], "baseline_tok_s": [100.0, 110.0],
                          "mean_acceptance_length": [float("nan")] * 2})
    fig = plots.al_and_speed_vs_k(pd.DataFrame(), speed, 0.1, title="t")
    ax_al, ax_tp = fig.axes
    assert not ax_al.lines[0].get_label().startswith("AL")  # only the k+1 ceiling
    assert sorted(line.get_ydata()[0] for line in ax_tp.lines) == [100.0, 110.0]
