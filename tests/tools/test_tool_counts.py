"""Spec (issue 77): `python -m tinydiff.tools.eval`'s count flags at 10^6 and 10^9, each run in a subprocess under a
4 GiB address-space cap (hostile.run_capped): a bounded run that says once what it clamped, or one `error:` line
naming the largest value that works. --batch-size 10^6 once asked for 37 GB of logits on the pinned stories."""
import pytest
from conftest import write_stories
from hostile import run_capped

from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.model import ModelConfig, Transformer

HUGE = (10**6, 10**9)


def assert_refused(res, *words):
    """Exit != 0, no traceback, exactly one `error:` line holding `words`."""
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert len(errors) == 1 and all(w in errors[0] for w in words), res.stderr[-2000:]


@pytest.fixture
def models(tmp_path):
    paths = {}
    for kind, causal in (("ar", True), ("mdlm", False)):
        config = ModelConfig(context=32, n_layer=1, n_head=2, d_model=16, d_ff=32, causal=causal)
        save_checkpoint(tmp_path / f"{kind}.pt", kind=kind, config=config, model=Transformer(config))
        paths[kind] = tmp_path / f"{kind}.pt"
    return paths


def evaluate(models, data, *flags, kind="ar"):
    return run_capped(["-m", "tinydiff.tools.eval", "--ckpt", models[kind], "--data", data, *flags])


@pytest.mark.parametrize("n", HUGE)
def test_a_batch_past_the_windows_is_one_batch(models, story_file, n):
    res = evaluate(models, story_file, "--batch-size", n, kind="mdlm")  # 40 stories: a few dozen windows
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.count(f"notice: --batch-size {n} is more than the ") == 1 and "ELBO bound" in res.stdout


@pytest.mark.parametrize("n", HUGE)
def test_a_batch_whose_logits_pass_a_gib_is_refused(models, tmp_path, n):
    data = write_stories(tmp_path / "many.txt", 1000)  # about a thousand 32-token windows: 6 GB of logits at once
    assert_refused(evaluate(models, data, "--batch-size", n), f"--batch-size {n}", "pass at most 166")


@pytest.mark.parametrize("flag, n", [("--samples", HUGE[0]), ("--samples", HUGE[1]), ("--gen-length", HUGE[0]),
                                     ("--gen-length", HUGE[1]), ("--block-length", HUGE[1])])
def test_a_judged_count_past_its_bound_is_one_line(models, story_file, flag, n):
    judged = {"--samples": "2", "--gen-length": "8", "--block-length": "8", flag: n}
    res = evaluate(models, story_file, "--judge", models["ar"], *[x for kv in judged.items() for x in kv],
                   kind="mdlm")
    assert_refused(res, flag)
