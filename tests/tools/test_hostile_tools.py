"""Spec: the measuring tools (`python -m tinydiff.bench`, `python -m tinydiff.bench.quality`) under careless
and hostile input: every number checked at the command line, every output path before the minutes
of work that end in writing it; each refusal one `error:` line that writes nothing."""
import pytest
from hostile import NON_FINITE, refused

from tinydiff.bench import quality
from tinydiff.bench import table as bench

BENCH = {"--entropy-bound": ["-1"], "--new-tokens": ["0", "-1", "1.5"], "--prompts": ["0", "-2"],
         "--temperature": ["-1", "1e-30", "1e9"], "--seed": ["-1", str(2**64)]}
QUALITY = {"--route-guard": ["0"], "--route-threshold": ["0", "2"], "--route-mask-vote": ["0"], "--k": ["0"],
           "--samples": ["0", "-1", "many"], "--gen-length": ["0"], "--block-length": ["0"],
           "--temperature": ["-1", "1e-30"], "--threshold": ["0", "1.5"], "--entropy-bound": ["-1"],
           "--revise": ["-1"], "--thresholds": ["0.9,0", "0.9,x", ","], "--entropy-bounds": ["1,-1", ""]}


def cases(table):
    return [(flag, value) for flag, values in table.items() for value in [*values, *NON_FINITE]]


@pytest.mark.parametrize("flag, value", cases(BENCH))
def test_the_bench_refuses_every_bad_number(tmp_path, capsys, monkeypatch, flag, value):
    monkeypatch.chdir(tmp_path)
    assert f"argument {flag}:" in refused(bench.main, ["--methods", "ar", flag, value], capsys, tmp_path)


@pytest.mark.parametrize("flag, value", cases(QUALITY))
def test_the_quality_tool_refuses_every_bad_number(tmp_path, capsys, monkeypatch, flag, value):
    monkeypatch.chdir(tmp_path)
    line = refused(quality.main, ["--judge", "j.pt", "--ar", "a.pt", flag, value], capsys, tmp_path)
    assert f"argument {flag}:" in line


@pytest.mark.parametrize("main, argv, message", [
    (bench.main, ["--methods", "ar", "--json", "missing/x.json"], "--json missing/x.json: its folder"),
    (bench.main, ["--methods", "ar", "--json", "."], "is a folder"),
    (bench.main, ["--methods", "ar", "--device", "tpu"], "--device must be cpu or cuda"),
    (bench.main, ["--methods", "ar,nope"], "unknown method(s) nope"),
    (quality.main, ["--judge", "j.pt", "--ar", "a.pt", "--curve", "--json", "missing/c.json"], "its folder"),
    (quality.main, ["--judge", "j.pt", "--ar", "a.pt", "--curve", "--plot", "missing/c.png"], "its folder"),
    (quality.main, ["--judge", "j.pt", "--ar", "a.pt", "--samplers", "nope"], "unknown sampler(s) nope"),
    (quality.main, ["--judge", "j.pt"], "nothing to sample from"),
])
def test_what_the_tools_write_at_the_end_is_checked_first(tmp_path, capsys, monkeypatch, main, argv, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "load_models", lambda args: pytest.fail("loaded models before checking its flags"))
    monkeypatch.setattr(quality, "load_model", lambda *a, **k: pytest.fail("loaded a model before checking"))
    assert message in refused(main, argv, capsys, tmp_path)
