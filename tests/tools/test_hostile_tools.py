"""Spec: the tools around a model (`python -m tinydiff.bench`, `.bench.quality`, `.tools.eval`, `.tools.quantize`,
`.tools.export`) under careless and hostile input: every number checked at the command line, every output
path before the minutes of work that end in writing it, every damaged or tampered checkpoint (and a FIFO
named as one) refused by each tool that reads one; each refusal one `error:` line that writes nothing."""
import os

import pytest
import torch
from hostile import NON_FINITE, refused, tampered_checkpoints

from tinydiff.bench import quality
from tinydiff.bench import table as bench
from tinydiff.model import ModelConfig, Transformer
from tinydiff.tools import eval as evaluate
from tinydiff.tools import export, quantize

BENCH = {"--entropy-bound": ["-1"], "--new-tokens": ["0", "-1", "1.5"], "--prompts": ["0", "-2"],
         "--temperature": ["-1", "1e-30", "1e9"], "--seed": ["-1", str(2**64)]}
QUALITY = {"--route-guard": ["0"], "--route-threshold": ["0", "2"], "--route-mask-vote": ["0"], "--k": ["0"],
           "--samples": ["0", "-1", "many"], "--gen-length": ["0"], "--block-length": ["0"],
           "--temperature": ["-1", "1e-30"], "--threshold": ["0", "1.5"], "--entropy-bound": ["-1"],
           "--revise": ["-1"], "--thresholds": ["0.9,0", "0.9,x", ","], "--entropy-bounds": ["1,-1", ""]}
EVAL = {"--mc": ["0", "1", "-1", "1.5", "10001"], "--batch-size": ["0", "-1", "1.5"], "--samples": ["0", "x"],
        "--gen-length": ["0"], "--block-length": ["0", "-4"]}
QUANTIZE = {"--block-size": ["0", "1", "4097", "1.5"]}


def cases(table):
    return [(flag, value) for flag, values in table.items() for value in [*values, *NON_FINITE]]


# tool -> its main, the rest of a command line that would run, its table of bad numbers
NUMBERS = {"bench": (bench.main, ["--methods", "ar"], BENCH),
           "quality": (quality.main, ["--judge", "j.pt", "--ar", "a.pt"], QUALITY),
           "eval": (evaluate.main, ["--ckpt", "m.pt"], EVAL),
           "quantize": (quantize.main, ["--ckpt", "m.pt", "--out", "q.pt"], QUANTIZE)}


@pytest.mark.parametrize("tool, flag, value", [(tool, flag, value) for tool, (_, _, table) in NUMBERS.items()
                                               for flag, value in cases(table)])
def test_every_tool_refuses_every_bad_number(tmp_path, capsys, monkeypatch, tool, flag, value):
    main, argv, _ = NUMBERS[tool]
    monkeypatch.chdir(tmp_path)
    assert f"argument {flag}:" in refused(main, [*argv, flag, value], capsys, tmp_path)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """name -> a checkpoint damaged one way (hostile.tampered_checkpoints), and a FIFO where a file should be."""
    folder = tmp_path_factory.mktemp("damaged")
    config = ModelConfig(context=32, n_layer=2, n_head=2, d_model=32, d_ff=64)
    torch.manual_seed(0)
    paths = tampered_checkpoints(folder / "bad", Transformer(config).eval(), config)
    os.mkfifo(folder / "fifo")  # a reader that opened it would wait for a writer forever
    return {**paths, "a fifo": folder / "fifo"}


TOOLS = {"eval": lambda ckpt, story: (evaluate.main, ["--ckpt", ckpt, "--data", story]),
         "quantize": lambda ckpt, story: (quantize.main, ["--ckpt", ckpt, "--out", "q.pt"]),
         "export": lambda ckpt, story: (export.main, ["--ckpt", ckpt, "--out", "hf"]),
         "bench": lambda ckpt, story: (bench.main, ["--ckpt", ckpt, "--methods", "ar", "--prompts", "1"]),
         "quality": lambda ckpt, story: (quality.main, ["--judge", ckpt, "--ar", ckpt, "--samples", "1"])}
DAMAGE = ["huge n_layer", "n_head 0", "string size", "float size", "norm_eps -1", "other vocabulary", "wrong shape",
          "missing weights", "missing config", "unknown kind", "no kind", "negative step", "NaN weights",
          "config a list", "weights not tensors", "code inside", "plain pickle", "truncated", "empty", "a folder",
          "a fifo"]


@pytest.mark.parametrize("tool", TOOLS)
def test_every_tool_refuses_every_damaged_checkpoint_and_runs_no_code(tmp_path, capsys, monkeypatch, damaged,
                                                                      story_file, tool):
    """(export wrote a folder from a checkpoint whose weights did not fit its config before 2026-12-06.)"""
    assert set(DAMAGE) == set(damaged)
    monkeypatch.chdir(tmp_path)
    for name in DAMAGE:
        main, argv = TOOLS[tool](damaged[name], story_file)
        refused(main, argv, capsys, tmp_path)
    assert not (tmp_path / "pwned.txt").exists()


@pytest.mark.parametrize("main, argv, message", [
    (bench.main, ["--methods", "ar", "--json", "missing/x.json"], "--json missing/x.json: its folder"),
    (bench.main, ["--methods", "ar", "--json", "."], "is a folder"),
    (bench.main, ["--methods", "ar", "--device", "tpu"], "--device must be cpu or cuda"),
    (bench.main, ["--methods", "ar,nope"], "unknown method(s) nope"),
    # a flag none of the chosen rows reads would change nothing
    *[(bench.main, ["--methods", rows, flag, value], f"{flag} is read by no row of --methods {rows}")
      for rows, flag, value in [("ar", "--drafter", "d.pt"), ("spec-k2", "--eagle", "e.pt"), ("ar", "--moe", "m.pt"),
                                ("diffusion-distilled-t0.9", "--mdlm", "m.pt"), ("diffusion", "--distilled", "x.pt"),
                                ("diffusion-distilled-t0.9", "--distilled-draft", "x.pt"),
                                ("diffusion", "--entropy-bound", "0.3"), ("dflash-b16", "--min-confidence", "0.5"),
                                ("spec-k2", "--draft-vocab", "100")]],
    (bench.main, ["--methods", "ar", "--report-preset", "13m"], "add --report DIR or drop it"),
    *[(quality.main, ["--judge", "j.pt", "--ar", "a.pt", flag, value], f"{flag} is a --curve setting")
      for flag, value in [("--thresholds", "0.9"), ("--data", "s.txt"), ("--json", "c.json"), ("--reuse", "c.json"),
                          ("--self-spec-drafts", "2")]],
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
