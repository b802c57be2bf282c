"""Progress lines: one per finished point with status, duration and ETA; forwarded from a
notebook's stdout to the terminal, tagged with the notebook."""

import io

from speclab import progress


def test_forwarder_passes_only_complete_progress_lines():
    out = io.StringIO()
    fwd = progress.LineForwarder("01_sweep", out)
    fwd.write("a table row\n[speclab] sweep x: 1/2 k0 ")
    assert out.getvalue() == ""
    fwd.write("ok in 3 s\nnoise\r[speclab] last\n")
    assert out.getvalue() == ("[speclab] [01_sweep] sweep x: 1/2 k0 ok in 3 s\n"
                              "[speclab] [01_sweep] last\n")


def test_durations_read_naturally():
    assert [progress.duration(s) for s in (4.4, 65, 3720)] == ["4 s", "1 min 05 s", "1 h 02 min"]


def test_sweep_prints_a_line_per_point(tmp_path, monkeypatch, capsys):
    from fake_requests import request

    from speclab import fingerprint, launch, profiles, store, sweep

    progress.log_to_stdout()
    prof = profiles.load("tiny-cpu", {"grid": {"method": ["eagle3"],
                                               "num_speculative_tokens": [0, 1, 2]},
                                      "timed_passes": 1})
    points = sweep.expand(prof)
    done = store.PointResult(  # an earlier run's
        point_id=points[0].id, status="ok", point=points[0].model_dump(mode="json"),
        n_requests=1, fingerprint=fingerprint.of_point(prof, points[0]))
    store.write_point(tmp_path, done, [request(points[0].id)])
    monkeypatch.setattr(launch, "prepare_models", lambda *a: None)
    monkeypatch.setattr(launch, "run_point", lambda prof, p, run_dir, fp=None: {
        "point_id": p.id, "status": "ok" if p.k == 1 else "error", "error": "boom", "wall_s": 65})
    sweep.run(prof, tmp_path, points)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[speclab] sweep")]
    assert lines[0] == "[speclab] sweep tiny-cpu: 1 of 3 points measured earlier with these " \
                       "settings, kept"
    assert lines[1].startswith(f"[speclab] sweep tiny-cpu: 1/2 {points[1].id} ok on ")
    assert " in 1 min 05 s; ETA " in lines[1]
    assert lines[2].startswith(f"[speclab] sweep tiny-cpu: 2/2 {points[2].id} error on ")
    assert lines[2].endswith("; sweep done") and len(lines) == 3


def test_progress_and_warnings_are_records_of_the_speclab_logger(tmp_path, monkeypatch):
    import logging

    from speclab import launch, profiles, sweep

    got = []
    h = logging.Handler()
    h.emit = lambda r: got.append((r.name, r.levelname, r.getMessage()))
    logging.getLogger("speclab").addHandler(h)
    monkeypatch.setattr(logging.getLogger("speclab"), "level", logging.INFO)
    prof = profiles.load("tiny-cpu", {"grid": {"num_speculative_tokens": [0]},
                                      "timed_passes": 1})
    monkeypatch.setattr(launch, "prepare_models", lambda *a: None)
    monkeypatch.setattr(launch, "run_point", lambda prof, p, run_dir, fp=None: {
        "point_id": p.id, "status": "error", "error": "boom", "wall_s": 1})
    try:
        sweep.run(prof, tmp_path)
    finally:
        logging.getLogger("speclab").removeHandler(h)
    names = {(n, lvl) for n, lvl, _ in got}
    assert ("speclab.executors", "INFO") in names and ("speclab.sweep", "WARNING") in names
    assert any(m.startswith("sweep tiny-cpu: 1/1 ") for _, _, m in got)


def test_timing_rounds_announce_themselves(tmp_path, monkeypatch, capsys):
    from speclab import launch, profiles, sweep

    progress.log_to_stdout()
    prof = profiles.load("tiny-cpu", {"grid": {"method": ["eagle3"],
                                               "num_speculative_tokens": [0, 1]},
                                      "timed_passes": 3})
    monkeypatch.setattr(launch, "prepare_models", lambda *a: None)
    monkeypatch.setattr(launch, "run_point", lambda prof, p, run_dir, fp=None: {
        "point_id": p.id, "status": "ok" if p.k == 0 else "error", "error": "x", "wall_s": 1,
        "passes": [{"round": 1}]})
    rounds = []
    monkeypatch.setattr(launch, "timing_round", lambda prof, p, run_dir, rnd: rounds.append(
        (p.id, rnd)) or {"point_id": p.id, "status": "ok", "passes": [{}] * rnd})
    sweep.run(prof, tmp_path)
    lines = [x for x in capsys.readouterr().out.splitlines() if "timing round" in x]
    assert lines == ["[speclab] sweep tiny-cpu: timing round 2 of 3, 1 point(s)",
                     "[speclab] sweep tiny-cpu: timing round 3 of 3, 1 point(s)"]
    assert [r for _, r in rounds] == [2, 3]  # the failed point is not timed again
