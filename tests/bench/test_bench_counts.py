"""Spec (issue 77): the count flags of `python -m tinydiff.bench` and `python -m tinydiff.bench.quality` at 10^6
and 10^9, each run in a subprocess under a 4 GiB address-space cap (hostile.run_capped): a bounded run that says
once what it clamped, or one `error:` line naming the largest value that works. Before: quality's --k, --draft-positions
and --ar-drafted-drafts at 10^9 were MemoryErrors, --samples and --revise runs of years, the bench's --openings
--prompts 10^9 a 7.5 GiB array. `python -m tinydiff.bench.hf`'s --ks and `python -m tinydiff.bench.kernels`' --reps
and --seed too: --ks 10^9 was a MemoryError (a 10^9-slot histogram), --reps 10^6 hours of timing, a seed past 64
bits a traceback."""
import importlib

import pytest
import torch
from hostile import refused, run_capped

from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.model import ModelConfig, Transformer

HUGE = (10**6, 10**9)


def assert_refused(res, *words):
    """Exit != 0, no traceback, exactly one `error:` line holding `words`."""
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert len(errors) == 1 and all(w in errors[0] for w in words), res.stderr[-2000:]


def assert_clamped(res, notice: str):
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.count(notice) == 1, res.stderr[-2000:]


@pytest.fixture
def models(tmp_path):
    paths = {}
    for name, causal in (("ar", True), ("mdlm", False), ("draft", True)):
        config = ModelConfig(context=32, n_layer=1, n_head=2, d_model=16, d_ff=32, causal=causal)
        save_checkpoint(tmp_path / f"{name}.pt", kind="ar" if causal else "mdlm", config=config,
                        model=Transformer(config))
        paths[name] = tmp_path / f"{name}.pt"
    return paths


def bench(models, *flags):
    return run_capped(["-m", "tinydiff.bench", "--ckpt", models["ar"], "--draft", models["draft"], "--prompts", "1",
                       "--new-tokens", "4", *flags])


def quality(models, *flags):
    return run_capped(["-m", "tinydiff.bench.quality", "--judge", models["ar"], "--samples", "2", "--gen-length", "8",
                       "--block-length", "8", *flags])


@pytest.mark.parametrize("n", HUGE)
def test_bench_held_out_openings_are_bounded(models, story_file, n):
    res = bench(models, "--methods", "ar", "--openings", "--data", story_file, "--prompts", n)
    assert_refused(res, f"--prompts {n}", "pass at most 10,000")


@pytest.mark.parametrize("flag, extra", [("--new-tokens", ["--methods", "ar"]),
                                         ("--draft-vocab", ["--methods", "spec-k2-fr", "--data"])])
def test_bench_tokens_and_vocabulary_past_the_model_are_one_line(models, story_file, flag, extra):
    extra = [*extra, story_file] if extra[-1] == "--data" else extra
    assert_refused(bench(models, *extra, flag, 10**9), "1000000000")


@pytest.mark.parametrize("flag, n", [("--samples", 10**9), ("--revise", 10**6)])
def test_quality_counts_that_are_a_runs_length_are_bounded(models, flag, n):
    res = quality(models, "--mdlm", models["mdlm"], "--samplers", "diffusion-revise", flag, n)
    assert_refused(res, f"argument {flag}:")


@pytest.mark.parametrize("n", HUGE)
def test_quality_speculative_drafts_are_clamped_to_a_round(models, n):
    res = quality(models, "--mdlm", models["mdlm"], "--ar", models["ar"], "--draft", models["draft"], "--curve",
                  "--thresholds", "0.9", "--entropy-bounds", "0.1", "--k", n)
    assert_clamped(res, f"notice: --k {n} is more than the 7 drafts a round of 8 new tokens can use")
    assert "draft k = 7" in res.stdout


@pytest.mark.parametrize("n", HUGE)
def test_quality_drafted_positions_are_clamped_to_a_block(models, n):
    res = quality(models, "--student", models["mdlm"], "--student-draft", models["draft"], "--draft-positions", n,
                  "--samplers", "distilled-self-spec,distilled-ar-drafted")
    assert_clamped(res, f"notice: --draft-positions {n} is more than a block's 8 positions")


@pytest.mark.parametrize("n", HUGE)
def test_quality_curve_draft_lists_are_clamped_to_a_block(models, n):
    res = quality(models, "--student", models["mdlm"], "--student-draft", models["draft"], "--curve",
                  "--thresholds", "0.9", "--entropy-bounds", "0.1", "--self-spec-drafts", f"2,{n}",
                  "--ar-drafted-drafts", n)
    for flag in ("--self-spec-drafts", "--ar-drafted-drafts"):
        assert_clamped(res, f"notice: {flag} {n} is more than a block's 8 positions")
    assert "self-speculative 8" in res.stdout and "ar-drafted 8" in res.stdout


def test_hf_drafts_past_a_round_are_clamped(models):
    """--ks 10^9 with 4 new tokens drafts 3 a round, said once; the clamped row is spec-k3, beside spec-k2."""
    pytest.importorskip("transformers")
    res = run_capped(["-m", "tinydiff.bench.hf", "--target", models["ar"], "--draft", models["draft"],
                      "--max-new-tokens", "4", "--ks", f"2,{10**9}"], timeout=120)
    assert_clamped(res, f"notice: --ks {10**9} is more than the 3 drafts a round of a 4-token story can use")
    assert [line.split()[0] for line in res.stdout.splitlines()[2:]] == ["greedy", "sample", "spec-k2", "spec-k3"]


@pytest.mark.parametrize("n", HUGE)
def test_hf_tokens_past_the_context_are_refused_before_the_export(models, tmp_path, capsys, monkeypatch, n):
    """The target's 32-token context holds at most 17 new tokens after the longest prompt: one line, before the
    checkpoints are exported or transformers loads them (the export here would fail the test)."""
    pytest.importorskip("transformers")
    from tinydiff.bench import hf

    def export(*args):
        raise AssertionError("exported before the check")
    monkeypatch.setattr(hf, "write_folder", export)
    argv = ["--target", models["ar"], "--draft", models["draft"], "--max-new-tokens", n]
    assert refused(hf.main, argv, capsys, tmp_path).endswith("passes the target's context: at most 17")


def test_kernel_bench_repetitions_past_their_bound_are_one_line():
    res = run_capped(["-m", "tinydiff.bench.kernels", "--kernels", "sampler", "--reps", 10**6], timeout=60)
    assert_refused(res, "argument --reps:", "<= 10,000,")


@pytest.mark.parametrize("module", ["hf", "kernels"])
def test_a_seed_past_32_bits_is_one_line(module, tmp_path, capsys):
    """Refused by argparse, before any work: in-process (kernels is imported when called, as test_cli does)."""
    main = importlib.import_module(f"tinydiff.bench.{module}").main
    argv = ["--target", "t.pt", "--draft", "d.pt"] if module == "hf" else []
    assert "<= 4,294,967,295," in refused(main, [*argv, "--seed", 10**30], capsys, tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: --device cuda is a good run there")
def test_the_kernel_bench_checks_its_device_and_output_before_any_work(tmp_path, capsys):
    """Once a traceback (`Torch not compiled with CUDA enabled`) and a --json opened only after the first row."""
    main = importlib.import_module("tinydiff.bench.kernels").main
    assert "no CUDA GPU is visible" in refused(main, ["--device", "cuda"], capsys, tmp_path)
    assert "does not exist" in refused(main, ["--json", tmp_path / "missing" / "rows.json"], capsys, tmp_path)
