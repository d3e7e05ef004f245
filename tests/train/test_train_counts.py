"""Spec (issue 77): train.py's count flags at 10^6 and 10^9, each run in a subprocess under a 4 GiB address-space cap
(hostile.run_capped). A count that allocates in proportion (the batch, the validation windows, the stories a target
or teacher writes) is refused in one `error:` line naming its largest value; --max-steps allocates nothing in
proportion, so 10^9 steps is a long run that starts training under the cap. --regenerate 10^6 once held the
stories' tokens in a list of about 9 GB."""
import re
import subprocess

import pytest
from hostile import run_capped

from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.model import ModelConfig, Transformer


def base(story_file, out):
    return ["train.py", "--data", story_file, "--out", out, "--preset", "draft", "--context", "16",
            "--batch-size", "2", "--max-steps", "2", "--eval-every", "2", "--eval-batches", "1", "--device", "cpu"]


@pytest.fixture
def target(tmp_path):
    config = ModelConfig(context=32, n_layer=1, n_head=2, d_model=16, d_ff=32)
    save_checkpoint(tmp_path / "target.pt", kind="ar", config=config, model=Transformer(config))
    return tmp_path / "target.pt"


@pytest.mark.parametrize("flag, n, largest", [("--regenerate", 10**6, "100,000"), ("--regenerate", 10**9, "100,000"),
                                              ("--distill-stories", 10**6, "100,000"),
                                              ("--batch-size", 10**9, "65,536"), ("--eval-batches", 10**9, "10,000")])
def test_a_count_held_in_memory_is_refused_past_its_bound(story_file, tmp_path, target, flag, n, largest):
    extra = {"--regenerate": ["--model", "ar", "--target", target],
             "--distill-stories": ["--distill", target]}.get(flag, [])
    res = run_capped([*base(story_file, tmp_path / "out"), *extra, flag, n])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert len(errors) == 1 and f"argument {flag}:" in errors[0] and f"<= {largest}," in errors[0], res.stderr
    assert not (tmp_path / "out").exists()


def test_a_billion_steps_train_under_the_cap(story_file, tmp_path):
    """Nothing is sized by --max-steps: the run starts its steps (it is stopped after a few seconds of them)."""
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        run_capped([*base(story_file, tmp_path / "out"), "--max-steps", 10**9, "--eval-every", "1"], timeout=20)
    out, err = (text.decode() if isinstance(text, bytes) else text or "" for text in (stopped.value.stdout,
                                                                                     stopped.value.stderr))
    assert re.search(r"^step \d+ \|", out, re.M), out[-2000:]
    assert "Traceback" not in err and "MemoryError" not in err, err[-2000:]


def test_validation_windows_are_bounded_by_their_product(story_file, tmp_path):
    """--eval-batches and --batch-size each pass their bounds; 10,000 x 1,024 windows of 16 tokens held 1.2 GiB
    up front."""
    res = run_capped([*base(story_file, tmp_path / "out"), "--eval-batches", "10000", "--batch-size", "1024"])
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert len(errors) == 1 and "pass --eval-batches 8192 or less" in errors[0], res.stderr[-2000:]
