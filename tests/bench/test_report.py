"""Spec: `python -m tinydiff.bench --report DIR` (tinydiff/bench/report.py). From nothing it trains every
model the bench uses (continuing a run that Ctrl-C stopped), runs every method, and writes its
section of DIR/RESULTS.md between the markers, keeping the hand-written rest of the file byte for
byte; a second run reuses the trained models and replaces the section; plots appear exactly when
matplotlib is importable; a user's mistakes are one-line UserErrors raised before any training."""
import argparse
import itertools
import os
import signal
from importlib.util import find_spec
from pathlib import Path

import pytest
from conftest import write_stories

import train
from tinydiff.bench import table as bench
from tinydiff.bench.report import END, PLOTS, START, splice
from tinydiff.bench.report_models import ROLES
from tinydiff.bench.temperatures import parse_temperatures
from tinydiff.checks import UserError
from tinydiff.io.checkpoint import load_checkpoint, save_checkpoint
from tinydiff.io.files import claim_run_folder
from tinydiff.model import ModelConfig, Transformer

HAND = "\nEvery number here was measured.\n\n## An older section\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"


@pytest.fixture
def stories(tmp_path):  # enough stories that the validation split holds a 129-token window
    return write_stories(tmp_path / "stories.txt", 300)


def report(stories, *extra):
    return bench.main(["--report", "docs", "--report-preset", "smoke", "--data", str(stories),
                       "--new-tokens", "4", "--prompts", "1", "--device", "cpu", *extra])


def outside(text):
    """The file without its generated block."""
    head, rest = text.split(START)
    return head + rest.split(END)[1]


def test_report_trains_measures_and_keeps_the_hand_written_file(stories, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("docs").mkdir()
    Path("docs/RESULTS.md").write_text("# Results\n" + HAND, encoding="utf-8")
    root = Path("out/report-smoke")
    real = train.training_loss
    loss_fn, extra = real("ar")

    def ctrl_c(model, windows, generator):  # as the user would: train.py saves after this step, returns
        if model.training:
            os.kill(os.getpid(), signal.SIGINT)
        return loss_fn(model, windows, generator)
    with monkeypatch.context() as patched:
        patched.setattr(train, "training_loss", lambda kind: (ctrl_c, extra) if kind == "ar" else real(kind))
        with pytest.raises(UserError, match="interrupted while training .*; run the same command again"):
            report(stories)
    assert load_checkpoint(root / "target/ckpt.pt")["step"] == 1
    assert Path("docs/RESULTS.md").read_text(encoding="utf-8") == "# Results\n" + HAND

    first = report(stories, "--json", "report.json")
    assert "resuming" in (root / "target/train.log").read_text()
    for role, (_, kind) in ROLES.items():  # every model trained to the end of its run
        ckpt = load_checkpoint(root / role / "ckpt.pt")
        assert ckpt["kind"] == kind and ckpt["step"] == ckpt["args"]["max_steps"] == 2
    assert load_checkpoint(root / "draft/ckpt.pt")["args"]["target"] == str(root / "target/ckpt.pt")
    # the drafter and the EAGLE head trained on the very stories the draft did: regenerated once
    for role, name in itertools.product(("drafter", "eagle"), ("regenerated.u16", "regenerated-val.u16")):
        assert (root / role / name).read_bytes() == (root / "draft" / name).read_bytes()

    text = Path("docs/RESULTS.md").read_text(encoding="utf-8")
    assert text.startswith("# Results\n\n" + START + "\n") and text.count(START) == text.count(END) == 1
    assert text.split(END + "\n", 1)[1] == HAND  # everything after the title, byte for byte
    generated = text.split(START)[1].split(END)[0]
    # no student without --distilled; the ar-steps and -fused rows (one-graph twins) only when --methods names them
    measured = [m for m in bench.METHODS if bench.USES.get(m) != "distilled" and m not in bench.STEPS_ROWS
                and not m.endswith("-fused")]
    assert [r["method"] for r in first["rows"]] == measured and len(measured) < len(bench.METHODS)
    for name in measured:
        assert generated.count(f"\n| {name} | ") == 1
    rows = {r["method"]: r for r in first["rows"]}
    assert rows["ar"]["tau"] == rows["ar"]["speedup_vs_ar"] == rows["ar"]["target_forwards_per_token"] == 1
    assert all(r["heldout_nll"] > 0 for r in first["rows"])
    assert first["date"] in generated and first["commit"] in generated and first["device"] in generated
    assert "minutes, training included." in generated
    assert Path("report.json").exists() and len(first["prompts"]) == 1

    plots = sorted(p.name for p in Path("docs/plots").glob("*.png")) if Path("docs/plots").exists() else []
    if find_spec("matplotlib"):
        made = sorted(set(PLOTS) - {"acceptance_by_slot.png"})  # that one only with --temperatures
        assert plots == made and all(f"(plots/{name})" in generated for name in made)
    else:
        assert plots == [] and "Plots skipped" in generated

    logs = {role: (root / role / "train.log").read_text() for role in ROLES}
    second = report(stories, "--methods", "ar,spec-k2", "--prompts", "6",  # more openings than the fixed prompts
                    "--temperatures", "0,1")
    assert {role: (root / role / "train.log").read_text() for role in ROLES} == logs  # nothing retrained
    text = Path("docs/RESULTS.md").read_text(encoding="utf-8")
    assert text.count(START) == text.count(END) == 1 and outside(text) == "# Results\n\n\n" + HAND
    generated = text.split(START)[1].split(END)[0]
    assert [r["method"] for r in second["rows"]] == ["ar", "spec-k2"] and len(second["prompts"]) == 6
    assert "| ar | " in generated and "| spec-k4 | " not in generated  # replaced, not appended
    assert "minutes, every model reused." in generated
    # --temperatures: ar and spec-k2 again at T = 0 and 1; at 0 (the table's temperature, the same seed and
    # openings) spec-k2 makes the table's very rounds, at 1 it samples other ones
    sampled = second["temperatures"]
    assert list(sampled) == [0.0, 1.0] and all([r["method"] for r in rows] == ["ar", "spec-k2"] for rows in sampled.values())
    table_row, at_0, at_1 = second["rows"][1], sampled[0.0][1], sampled[1.0][1]
    assert at_0["accepted_hist"] == table_row["accepted_hist"] and at_0["tau"] == table_row["tau"]
    assert 0 <= at_1["alpha"] <= 1 and sampled[1.0][0]["speedup_vs_ar"] == 1
    section = generated.split("### Where users sample")[1]
    assert section.count("\n| spec-k2 | 0 | ") == section.count("\n| spec-k2 | 1 | ") == 1 and "\n| ar | " not in section
    plots = sorted(p.name for p in Path("docs/plots").glob("*.png")) if Path("docs/plots").exists() else []
    # no stale plot survives
    assert plots == (["acceptance_by_slot.png", "accepted_lengths.png"] if find_spec("matplotlib") else [])


def test_splice_keeps_every_byte_outside_the_markers():
    block = f"{START}\nnew\n{END}"
    assert splice(None, "new", "f") == f"# Results\n\n{block}\n"
    assert splice("# T\r\nbody\n", "new", "f") == f"# T\r\n\n{block}\nbody\n"
    assert splice("no title\n", "new", "f") == f"{block}\n\nno title\n"
    kept = f"# T\n\nintro\n{START}\nold\nlines\n{END}\n\n## Hand\ntext"
    assert splice(kept, "new", "f") == f"# T\n\nintro\n{block}\n\n## Hand\ntext"
    assert splice(splice(kept, "new", "f"), "new", "f") == splice(kept, "new", "f")
    for broken in (f"{START}\n", f"{END}\n{START}\n", f"{START}\n{END}\n{START}\n{END}\n"):
        with pytest.raises(UserError, match="leave one pair"):
            splice(broken, "new", "f")


def wrong_kind(path):
    model = Transformer(ModelConfig(context=16, n_layer=1, n_head=1, d_model=8, d_ff=8))
    save_checkpoint(path, kind="mdlm", config=model.config, model=model)
    return str(path)


@pytest.mark.parametrize("flags, message", [
    (["--report", "no/such/folder"], "pass a folder whose parent exists"),
    (["--report", "docs", "--report-preset", "huge"], "unknown --report-preset 'huge'"),
    (["--report", "docs", "--ckpt", "WRONG"], "holds a 'mdlm' model; the target must be a 'ar'"),
    (["--report", "docs", "--new-tokens", "500"], "--new-tokens must lie in"),
    (["--report", "bad-markers"], "leave one pair"),
    (["--prompts", "5"], r"--prompts must lie in \[1, 4\]"),
    (["--temperatures", "0,1"], "--temperatures adds a section to --report's RESULTS.md: add --report DIR"),
])
def test_user_mistakes_are_one_line_errors_before_any_training(flags, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("bad-markers").mkdir()
    Path("bad-markers/RESULTS.md").write_text(f"# R\n{END}\n{START}\n")
    flags = [wrong_kind(tmp_path / "mdlm.pt") if f == "WRONG" else f for f in flags]
    with pytest.raises(UserError, match=message) as error:
        bench.main([*flags, "--device", "cpu"])
    assert "\n" not in str(error.value)
    assert not Path("out").exists()


def test_a_report_into_a_folder_another_report_is_writing_is_refused_before_any_training(tmp_path, monkeypatch):
    """RESULTS.md is read at the start and spliced at the end: two reports at once would lose one's table."""
    monkeypatch.chdir(tmp_path)
    with claim_run_folder(Path("busy"), "--report"):  # the first report, alive
        with pytest.raises(UserError, match=r"another run \(PID \d+\) is using busy; .* another --report"):
            bench.main(["--report", "busy", "--device", "cpu"])
        assert [p.name for p in Path("busy").iterdir()] == [".lock"]  # the first one's lock alone
    assert not Path("out").exists()


def test_the_readme_shows_the_results_table_docs_holds():
    """README.md embeds the report's heading, device line and table header, and a row per method out of
    the report's table, each exactly as docs/RESULTS.md holds it; a new `--report docs` that the README
    was not updated for fails here, so the front page never shows stale numbers."""
    root = Path(__file__).resolve().parents[2]

    def table(text):  # the heading (it holds the date), the device line and the table's rows
        block = text.split(START, 1)[1].split(END, 1)[0]
        return [line.lstrip("#") for line in block.splitlines() if line.startswith(("|", "Device:", "#"))]
    results = table((root / "docs/RESULTS.md").read_text(encoding="utf-8"))
    shown = table((root / "README.md").read_text(encoding="utf-8"))
    assert len(results) > 3 and shown[:4] == results[:4]  # heading, device, the table's header and rule
    assert len(shown) > 5 and all(row in results for row in shown[4:])


def test_temperatures_parse_as_a_list_and_refuse_repeats_and_bad_values(capsys):
    assert parse_temperatures("0,0.8,1") == [0.0, 0.8, 1.0]
    for bad, message in (("0,0", "lists a temperature twice"), ("0,-1", "got '-1'"), ("0,,1", "got ''")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse_temperatures(bad)
    with pytest.raises(SystemExit) as exit_:  # as the bench's flag: argparse's one line, status 2
        bench.main(["--report", "docs", "--temperatures", "1,1"])
    assert exit_.value.code == 2 and "lists a temperature twice" in capsys.readouterr().err.strip().splitlines()[-1]
