"""Spec: generate.py and the bench as a user runs them: JSON output, and one-line errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tinydiff import bench
from tinydiff.checkpoint import save_checkpoint
from tinydiff.errors import UserError
from tinydiff.tokenizer import EOT, Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, "generate.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def ckpt(tmp_path, tiny_model, tiny_config):
    save_checkpoint(tmp_path / "ckpt.pt", kind="ar", config=tiny_config, model=tiny_model)
    return tmp_path / "ckpt.pt"


def test_json_output(ckpt):
    res = run("--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 6, "--temperature", 0, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    tok = Tokenizer()
    assert out["prompt_ids"] == [EOT] + tok.encode("Once upon a time")
    assert 1 <= len(out["ids"]) <= 6 and out["stats"]["new_tokens"] == len(out["ids"])
    assert out["text"] == "Once upon a time" + tok.decode([i for i in out["ids"] if i != EOT])
    assert out["stats"]["forwards"] == len(out["ids"]) and out["stats"]["tokens_per_s"] > 0


@pytest.mark.parametrize("args, message", [
    (["--prompt", ""], "the prompt is empty"),
    (["--prompt", "word " * 40], "context is 32"),
    (["--prompt", "hi", "--max-new-tokens", 0], "max new tokens"),
    (["--prompt", "hi", "--temperature", -1], "temperature"),
])
def test_bad_input_is_one_line(ckpt, args, message):
    res = run("--ckpt", ckpt, *args)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert message in res.stderr.strip().splitlines()[-1]


def test_bad_checkpoint_is_one_line(tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"\x00" * 10)
    res = run("--ckpt", tmp_path / "bad.pt", "--prompt", "hi")
    assert res.returncode != 0 and res.stderr.strip().startswith("error:") and "Traceback" not in res.stderr


def test_bench_ar_row(ckpt, tmp_path):
    report = bench.main(["--ckpt", str(ckpt), "--new-tokens", "5", "--prompts", "2",
                         "--json", str(tmp_path / "b.json")])
    assert json.loads((tmp_path / "b.json").read_text()) == report
    (row,) = report["rows"]
    assert row["method"] == "ar" and row["tau"] == 1 and row["target_forwards_per_token"] == 1
    assert row["speedup_vs_ar"] == 1 and row["tokens_per_s"] > 0 and report["device"]
    with pytest.raises(UserError, match="unknown method"):
        bench.main(["--methods", "nope"])
