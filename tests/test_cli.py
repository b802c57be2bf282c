"""`speclab run`/`sweep` options: papermill-style parameters, one spelling across commands."""

import pytest

from speclab import cli, paths


def parse(*argv):
    a = cli.build_parser().parse_args(["run", *argv])
    return cli._params(a.param, a.param_file), a


def test_run_takes_papermill_style_parameters(tmp_path):
    f = tmp_path / "params.yaml"
    f.write_text("mode: server\nconcurrency: [1, 4, 16]\nnear_tie: 0.1\n")
    params, a = parse("-f", str(f), "-p", "concurrency", "[1, 4]", "-p", "execute", "False",
                      "-p", "plain_runs", '["other"]', "-p", "arms", "None", "--profile", "x")
    assert params == {"mode": "server", "concurrency": [1, 4], "near_tie": 0.1,
                      "execute": False, "plain_runs": ["other"], "arms": None}
    assert a.profile == "x"


def test_key_equals_value_reads_the_same():
    assert parse("-p", "execute=false", "-p", "overrides={max_tokens: 8}")[0] == {
        "execute": False, "overrides": {"max_tokens": 8}}


def test_bad_parameters_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="-p expects KEY VALUE"):
        parse("-p", "execute")
    f = tmp_path / "p.yaml"
    f.write_text("- a list\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        parse("-f", str(f))
    with pytest.raises(ValueError, match="--override expects a mapping"):
        cli._override("[1, 2]")


def test_run_and_sweep_share_their_options():
    for cmd in ("run", "sweep"):
        a = cli.build_parser().parse_args([cmd, "--profile", "p", "--run-id", "r", "--out", "o",
                                           "--override", "{max_tokens: 8}"])
        assert (a.profile, a.run_id, a.out, cli._override(a.override)) == (
            "p", "r", "o", {"max_tokens": 8})


def test_unknown_profile_lists_the_shipped_ones(capsys):
    assert cli.main(["profile", "check", "no-such-profile"]) == 2
    err = capsys.readouterr().err
    assert "unknown profile 'no-such-profile'; available: " in err and "tiny-cpu" in err


def test_profile_check_warns_when_vllm_is_newer_than_the_matrix(monkeypatch, capsys):
    from speclab import preflight, vllm_matrix

    monkeypatch.setattr(preflight, "installed_vllm", lambda: "0.35.0")
    cli.main(["profile", "check", "tiny-cpu"])
    assert f"  warning: {vllm_matrix.horizon('0.35.0')}" in capsys.readouterr().out
    monkeypatch.setattr(preflight, "installed_vllm", lambda: vllm_matrix.RELEASES[-1])
    cli.main(["profile", "check", "tiny-cpu"])
    assert "warning:" not in capsys.readouterr().out


def test_fixtures_list_marks_named_only_and_param_is_checked(capsys, monkeypatch):
    from speclab import fixtures

    assert cli.main(["fixtures", "list"]) == 0
    out = capsys.readouterr().out
    assert "realshape-dsv4 (built only when named)" in out and "\ntiny-llama\n" in out
    with pytest.raises(SystemExit, match="FIXTURE.KEY=VALUE"):
        cli.main(["fixtures", "build", "realshape-dsv4", "--param", "num_layers=8"])
    seen = {}
    monkeypatch.setattr(fixtures, "build", lambda name, cache, **kw: seen.setdefault(name, kw))
    cli.main(["fixtures", "build", "realshape-dsv4-eagle3", "--param",
              "realshape-dsv4.num_layers=8", "--param", "realshape-dsv4.expert_dtype=fp8"])
    assert seen["realshape-dsv4-eagle3"]["params"] == {
        "realshape-dsv4": {"num_layers": 8, "expert_dtype": "fp8"}}


@pytest.mark.parametrize("cmd", ["run", "sweep"])
def test_a_run_id_that_is_a_path_is_refused_before_anything_runs(cmd, tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.setattr("speclab.report.run_suite", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr("speclab.sweep.run", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit) as e:
        cli.main([cmd, "--profile", "tiny-cpu", "--run-id", "data/runs/x", "--out",
                  str(tmp_path)])
    assert e.value.code == 2
    assert "'data/runs/x' is not a folder name" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a folder name"):  # the library refuses it too
        paths.run_folders("data/runs/x", tmp_path)
    # an absolute path names the run folder itself
    assert paths.run_folders(str(tmp_path / "r"), tmp_path)[0] == tmp_path / "r"
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("argv", [["bench", "--k", "-1"], ["bench", "--overhead", "--rounds", "0"],
                                  ["overlay", "plan", "--num-layers", "0"]])
def test_counts_below_their_minimum_are_refused_before_any_engine(argv, capsys, monkeypatch):
    """`bench --k -1` ran a plain engine and `--overhead --rounds 0` an engine that printed
    NaN; each is now an argparse error (exit 2) before anything loads."""
    monkeypatch.setattr("speclab.bench.main", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr("speclab.bench.overhead", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2 and "a whole number of at least" in capsys.readouterr().err


def test_concurrency_is_checked_and_needs_server_mode(tmp_path, capsys, monkeypatch):
    """`sweep --concurrency 0,x` ran the offline grid, the option ignored; now it is refused
    offline, and bad levels are refused in server mode, before any point runs."""
    monkeypatch.setattr("speclab.sweep.run", lambda *a, **k: pytest.fail("ran"))
    monkeypatch.setattr("speclab.server.run_point", lambda *a, **k: pytest.fail("ran"))
    base = ["sweep", "--profile", "tiny-cpu", "--out", str(tmp_path)]
    assert cli.main([*base, "--concurrency", "1,4"]) == 2
    assert "add --mode server" in capsys.readouterr().err
    assert cli.main([*base, "--mode", "server", "--concurrency", "0,x"]) == 2
    assert "request counts >= 1" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
