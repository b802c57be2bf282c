"""The explorer's tables, figure and widgets on committed results (data/runs)."""

import matplotlib
import pandas as pd
import pytest

from speclab import analysis, explorer, parity
from speclab.profiles import REPO

matplotlib.use("Agg")
DIAL = REPO / "data" / "runs" / "h200-dsv4-dial-20261130"
RIG = REPO / "data" / "runs" / "h200-dsv4-rig-20261130"


@pytest.fixture(scope="module")
def loaded():
    return explorer.load([DIAL, RIG])


def test_variant_names_what_sets_a_point_apart():
    base = {"k": 3, "kv_cache_dtype": "fp8"}
    assert explorer.variant({"point": base}) == "grid"
    assert explorer.variant({"point": {**base, "concurrency": 1, "repeat": 1}}) == "c1 r1"
    assert explorer.variant({"point": {**base, "env": {"VLLM_BATCH_INVARIANT": "1"}}}) == \
        "VLLM_BATCH_INVARIANT=1"
    assert explorer.variant({"point": base, "mode": "server", "concurrency": 4}) == "serve c4"


def test_find_runs_and_options(loaded, tmp_path):
    assert {DIAL, RIG} <= set(explorer.find_runs(REPO / "data" / "runs"))
    (tmp_path / "empty" / "points").mkdir(parents=True)
    assert explorer.find_runs(tmp_path) == []
    _, recs = loaded
    assert set(recs.run) == {DIAL.name, RIG.name}
    opts = explorer.options(recs, [DIAL.name])
    assert opts["k"] == [1, 2, 3, 4]
    assert opts["kv_cache_dtype"] == ["fp8"] and opts["draft_kv_cache_dtype"] == ["auto"]
    assert opts["category"][0] == explorer.ALL and opts["variant"] == ["grid"]
    sl = explorer.default_slice(recs, [DIAL.name])
    assert sl.k == 4 and sl.values["category"] == explorer.ALL


def test_tables_follow_the_slice(loaded):
    pts, recs = loaded
    sl = explorer.default_slice(recs, [DIAL.name])
    t = explorer.tables(pts, recs, sl)
    # AL per k is the per-request acceptance of that run's point
    mine = recs[(recs.run == DIAL.name) & (recs.k == 3)]
    want = analysis.acceptance(mine).mean_acceptance_length.iloc[0]
    assert t.acc[t.acc.k == 3].mean_acceptance_length.iloc[0] == pytest.approx(want)
    assert list(t.pos.position) == [0, 1, 2, 3]
    assert sorted(t.speed.k) == [0, 1, 2, 3, 4]  # the plain point stays in despite draft KV
    plain = recs[(recs.run == DIAL.name) & (recs.k == 0)]
    want = parity.summarize(parity.compare(plain, mine))
    got = t.parity.set_index("k").loc[3]
    assert (got.n, got.exact) == (want["n"], want["exact"])
    # another k: only the per-position table changes
    t2 = explorer.tables(pts, recs, explorer.Slice(sl.runs, 2, sl.values))
    assert list(t2.pos.position) == [0, 1]
    pd.testing.assert_frame_equal(t2.acc, t.acc)
    # a value no record has: empty, and the figure says so instead of failing
    t3 = explorer.tables(pts, recs, explorer.Slice(sl.runs, 2, {**sl.values, "layout": "tp8"}))
    assert t3.acc.empty
    fig = explorer.figure(t3, sl)
    assert any("no data" in x.get_text() for ax in fig.axes for x in ax.texts)


def test_category_slice_counts_only_its_prompts(loaded):
    pts, recs = loaded
    sl = explorer.default_slice(recs, [RIG.name])
    cat = sorted(recs[recs.run == RIG.name].category.unique())[0]
    t = explorer.tables(pts, recs, explorer.Slice(sl.runs, sl.k, {**sl.values, "category": cat}))
    n = ((recs.run == RIG.name) & (recs.category == cat) & (recs.k == sl.k)).sum()
    assert set(t.acc.n_requests) == {n}


def test_two_runs_side_by_side(loaded):
    pts, recs = loaded
    sl = explorer.default_slice(recs, [DIAL.name, RIG.name])
    t = explorer.tables(pts, recs, sl)
    assert set(t.acc.run) == {DIAL.name, RIG.name}
    text = explorer.summary(t, sl)
    assert len(text.splitlines()) == 2 and all(r in text for r in sl.runs)
    fig = explorer.figure(t, sl, draft_cost=0.25)
    labels = fig.axes[1].get_legend_handles_labels()[1]
    assert DIAL.name in labels and RIG.name in labels


def test_widget_redraws_on_control_changes():
    view = explorer.explorer([DIAL, RIG], draft_cost=0.25)
    controls, title, text, image = view.children
    runs = controls.children[0]
    k = controls.children[1].children[0]
    assert runs.value == (DIAL.name,) and k.value == 4 and "k=4" in title.value
    first = image.value
    assert first[:4] == b"\x89PNG"
    k.value = 1
    assert "k=1" in title.value and image.value != first
    runs.value = (DIAL.name, RIG.name)
    assert RIG.name in text.value and k.value == 1  # a value still offered is kept
    assert explorer.explorer([REPO / "nowhere"]).value.startswith("<b>no results</b>")
