"""Which CUDA graph a decode step replays, against what vLLM 0.26.0 captured on the H200."""

import json
import re
import tarfile
from pathlib import Path

import pytest

from speclab import cudagraphs

RUN = Path(__file__).parents[1] / "data/runs/h200-realshape-20261205-vllm026-deeprest"


def captured_decode_graphs() -> dict[str, int]:
    """Per engine of the committed run: how many FULL decode graphs its log says it captured
    ("Capturing CUDA graphs (decode, FULL): ... n/N")."""
    out = {}
    with tarfile.open(RUN / "logs.tar.gz") as tar:
        for m in tar.getmembers():
            name = Path(m.name).stem
            if m.isfile() and name.startswith("L"):
                text = tar.extractfile(m).read().decode(errors="replace")
                counts = re.findall(r"Capturing CUDA graphs \(decode, FULL\).*?\d+/(\d+)", text)
                out[name] = int(counts[-1])
    return out


def test_graphs_are_the_ones_vllm_captured():
    """The rows `decode_graphs` derives from each engine's resolved sizes are as many as the
    engine's log says it captured; the sizes as resolved (the control: no rounding to k + 1)
    are not, for every speculative engine."""
    seen = captured_decode_graphs()
    engines = [json.loads(x) for x in (RUN / "engines.jsonl").read_text().splitlines()]
    ready = {e["engine"]: e for e in engines if e.get("op") == "ready"}
    assert set(seen) == set(ready) == {"L32-k0-graphs", "L32-k2-graphs", "L32-k4-graphs"}
    for name, e in ready.items():
        sizes = e["resolved"]["cudagraph_capture_sizes"]
        assert len(cudagraphs.decode_graphs(e["k"] + 1, sizes)) == seen[name]
        assert (len(sizes) == seen[name]) == (e["k"] == 0)
    assert cudagraphs.decode_graphs(3, ready["L32-k2-graphs"]["resolved"][
        "cudagraph_capture_sizes"]) == [3, 6, 9, 18, 24, 33, 42, 48]


def test_graph_rows_pad_to_the_smallest_graph():
    assert [cudagraphs.graph_rows(b, 3) for b in (1, 2, 3, 4, 5, 8)] == [3, 6, 9, 18, 18, 24]
    assert [cudagraphs.graph_rows(b) for b in (1, 3, 5, 12, 17, 300)] == [1, 4, 8, 16, 24, 304]
    assert cudagraphs.graph_rows(20, 3, sizes=[1, 2, 4, 8, 16, 24, 32, 40, 48]) == 60  # none
    # 0.34.0 with its defaults: on Hopper q times 1, 2, 4, 8, ... requests are graphs too,
    # on SM100 every request count up to 6; with sizes set (gpubench) the 0.26 graphs
    assert [cudagraphs.graph_rows(b, 3, vllm="0.34") for b in (4, 5, 8)] == [12, 18, 24]
    assert cudagraphs.graph_rows(5, 3, gpu="blackwell", vllm="0.34") == 15
    assert cudagraphs.graph_rows(4, 3, sizes=[1, 2, 4, 8, 16, 24], vllm="0.34") == 18
    assert cudagraphs.graph_rows(4, 3, gpu="blackwell") == 18  # 0.26 rounds on any GPU
    assert len(cudagraphs.token_sizes(512)) == 51
    # vLLM 0.34.0's docstring of decode_cudagraph_capture_grid: "64 sizes at 1024"
    grid = cudagraphs.request_grid(1024)
    assert len(grid) == 64 and grid[:8] == [1, 2, 3, 4, 5, 6, 8, 10] and grid[-1] == 1024
    with pytest.raises(ValueError, match="gpu must be one of"):
        cudagraphs.graph_rows(4, 3, gpu="ampere")
    with pytest.raises(ValueError, match="requests must be positive"):
        cudagraphs.graph_rows(0)
    with pytest.raises(ValueError, match="the releases read"):
        cudagraphs.graph_rows(4, 3, vllm="0.30")


def test_verify_forward_costs_its_graphs_rows():
    """On the H200 (committed run), every verify forward of k = 2 costs the plain step at its
    graph's rows within 5%; priced at its tokens (the control), the 12-token step is 20%
    cheaper than measured."""
    from speclab import predict, stepcosts

    res = stepcosts.load(RUN)
    v = predict.verify_by_rows(res).dropna(subset=["plain_rows_ms"]).set_index("tokens")
    assert v.loc[12, "rows"] == v.loc[15, "rows"] == 18 and v.loc[9, "rows"] == 9
    assert ((v.execute_ms / v.plain_rows_ms - 1).abs() < 0.05).all() and len(v) >= 10
    curve = predict.rows_curve(stepcosts.step_costs(res), 32, False)
    assert predict.plain_at(curve, 12) == v.loc[12, "plain_tokens_ms"]
    assert v.loc[12, "plain_tokens_ms"] < 0.8 * v.loc[12, "execute_ms"]


def test_padding_share_per_batch_and_k():
    hop = {(r["B"], r["k"]): r for r in cudagraphs.padding((4, 5, 7), (1, 2, 3))}
    assert hop[4, 2]["rows"] == 18 and hop[4, 2]["padding"] == pytest.approx(1 / 3)
    assert hop[4, 1]["padding"] == hop[4, 3]["padding"] == 0
    assert hop[5, 1]["rows"] == 16 and hop[5, 1]["padding"] == pytest.approx(6 / 16)
    sm100 = {(r["B"], r["k"]): r["padding"]
             for r in cudagraphs.padding((4, 7), (2,), "blackwell", "0.34")}
    assert sm100 == {(4, 2): 0, (7, 2): pytest.approx(1 / 8)}  # grid 1..6, 8, 10, ...


def test_the_report_shows_graph_rows_and_padding(tmp_path):
    """predict.md of the committed run: the verify forwards by graph rows (12 tokens on the
    18-row graph), the padding table (B = 4: a third at k = 2 on 0.26, none on 0.34) and
    the GPU's idle time a step."""
    from speclab import predictreport

    md = predictreport.report(RUN, out_dir=tmp_path).read_text()
    rows = md[md.index("## Verify steps by CUDA-graph rows"):md.index("## Padding of")]
    assert "32 | False |  | 2 | 12 | 18 |" in rows
    pad = md[md.index("## Padding of"):md.index("## Step anatomy")]
    assert "\n4 | 0 | 33 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0 | 0\n" in pad
    assert "idle_ms" in md[md.index("## Step anatomy"):]
    assert (tmp_path / "figures" / "verify_rows.png").exists()
    assert "figures/verify_rows.png" in (tmp_path / "predict.html").read_text()
