"""Spec: generate.py as a user runs it: JSON output, and one-line errors (the bench: test_bench.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from entry_points import run_in_process

import generate
from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.model import Transformer
from tinydiff.tokenizer import EOT, MASK, Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def run_process(*args):
    """generate.py exactly as a user runs it: a fresh interpreter."""
    return subprocess.run([sys.executable, "generate.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def run(*args):
    """generate.py's entry point in this process (tests/entry_points.py)."""
    return run_in_process(generate.main, *args)



def test_json_output(ckpt):
    res = run_process("--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 6, "--temperature", 0, "--json")
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
    (["--prompt", "hi", "--max-new-tokens", 0], "--max-new-tokens: must be an integer >= 1"),
    (["--prompt", "hi", "--temperature", -1], "temperature"),
    (["--prompt", "hi", "--temperature", "nan"], "--temperature: must be 0 or a finite number"),  # it once wrote MASK ids
    (["--prompt", "hi", "--temperature", "inf"], "--temperature: must be 0 or a finite number"),
])
def test_bad_input_is_one_line(ckpt, args, message):
    res = run("--ckpt", ckpt, *args)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert message in res.stderr.strip().splitlines()[-1]


def test_bad_checkpoint_is_one_line(tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"\x00" * 10)
    res = run("--ckpt", tmp_path / "bad.pt", "--prompt", "hi")
    assert res.returncode != 0 and res.stderr.strip().startswith("error:") and "Traceback" not in res.stderr



def test_diffusion_json_output(mdlm_ckpt, ckpt):
    res = run("--ckpt", mdlm_ckpt, "--prompt", "Once upon a time", "--gen-length", 8, "--block-length", 4,
              "--steps", 4, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["ids"]) == 8 and MASK not in out["ids"]
    assert out["stats"]["forwards"] == 4 and out["stats"]["tokens_per_forward"] == 2
    res = run("--ckpt", mdlm_ckpt, "--prompt", "Once upon a time", "--gen-length", 8, "--block-length", 4, "--cached",
              "--entropy-bound", "1e9", "--json")  # a bound nothing reaches: each block in one forward
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["stats"]["forwards"] == 2
    common = ["--ckpt", mdlm_ckpt, "--prompt", "Once upon a time", "--gen-length", 8, "--block-length", 4, "--json"]
    one_per_step = json.loads(run(*common, "--cached", "--remasking", "left_to_right").stdout)
    res = run(*common, "--self-speculate", 3)  # left to right by default; greedy: the same tokens
    assert res.returncode == 0, res.stderr
    drafted = json.loads(res.stdout)
    assert drafted["ids"] == one_per_step["ids"] and drafted["stats"]["forwards"] <= 8
    assert len(drafted["stats"]["accepted"]) == 4 and drafted["stats"]["canvases"] > drafted["stats"]["forwards"]
    res = run(*common, "--self-speculate", 3, "--draft", ckpt)  # an AR draft proposes them: the same tokens again
    assert res.returncode == 0, res.stderr
    ar_drafted = json.loads(res.stdout)
    assert ar_drafted["ids"] == one_per_step["ids"] and ar_drafted["stats"]["forwards"] == ar_drafted["stats"]["rounds"]
    assert ar_drafted["stats"]["draft_forwards"] > 0 and len(ar_drafted["stats"]["accepted"]) == 4


def test_spec_equals_ar_at_temperature_zero(ckpt, tmp_path, tiny_config):
    draft_config = type(tiny_config)(**{**tiny_config.__dict__, "n_layer": 1})
    torch.manual_seed(2)
    save_checkpoint(tmp_path / "draft.pt", kind="ar", config=draft_config, model=Transformer(draft_config))
    common = ["--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 12, "--temperature", 0, "--json"]
    ar = json.loads(run(*common).stdout)
    spec = json.loads(run(*common, "--method", "spec", "--draft", tmp_path / "draft.pt", "--k", 3).stdout)
    vllm = '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 2}' % (tmp_path / "draft.pt")
    via_config = json.loads(run(*common, "--speculative-config", vllm).stdout)
    ssd = json.loads(run(*common, "--method", "ssd", "--draft", tmp_path / "draft.pt", "--k", 3,
                         "--fan-out", "0,0,0,1").stdout)  # one branch: after all 3 drafts pass
    assert spec["ids"] == ar["ids"] == via_config["ids"] == ssd["ids"]
    assert spec["stats"]["forwards"] == spec["stats"]["rounds"] and len(spec["stats"]["accepted"]) == 4
    assert ssd["stats"]["accepted"] == spec["stats"]["accepted"] and ssd["stats"]["hits"][:3] == [0, 0, 0]
    res = run(*common, "--method", "ssd", "--draft", tmp_path / "draft.pt", "--k", 3, "--fan-out", "0,1")
    assert res.returncode != 0 and "a list of k+1 = 4 integers" in res.stderr.strip().splitlines()[-1]
    assert len(via_config["stats"]["accepted"]) == 3
    for bad, message in (("{", "not valid JSON"), ('{"method": "eagle"}', "draft_model")):
        res = run("--ckpt", ckpt, "--prompt", "hi", "--speculative-config", bad)
        assert res.returncode != 0 and message in res.stderr.strip().splitlines()[-1]
    res = run("--ckpt", ckpt, "--prompt", "hi", "--method", "spec")
    assert "needs --draft" in res.stderr


def test_dflash_equals_ar_at_temperature_zero(ckpt, tmp_path, tiny_model):
    from tinydiff.dflash import DFlashConfig, DFlashDrafter
    config = DFlashConfig.for_target(tiny_model.config, block_size=4)
    torch.manual_seed(3)
    save_checkpoint(tmp_path / "drafter.pt", kind="dflash", config=config, model=DFlashDrafter(config, tiny_model))
    common = ["--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 12, "--temperature", 0, "--json"]
    ar = json.loads(run(*common).stdout)
    dflash = json.loads(run(*common, "--method", "dflash", "--drafter", tmp_path / "drafter.pt").stdout)
    vllm = '{"method": "dflash", "model": "%s", "num_speculative_tokens": 2}' % (tmp_path / "drafter.pt")
    via_config = json.loads(run(*common, "--speculative-config", vllm).stdout)
    scheduled = json.loads(run(*common, "--method", "dflash", "--drafter", tmp_path / "drafter.pt", "--rule", "reject",
                               "--min-confidence", 0.5).stdout)  # an untrained drafter: one draft verified a round
    assert dflash["ids"] == ar["ids"] == via_config["ids"] == scheduled["ids"]
    assert len(dflash["stats"]["accepted"]) == 4 and len(via_config["stats"]["accepted"]) == 3
    assert scheduled["stats"]["slot_judged"][0] > 0 and not any(scheduled["stats"]["slot_judged"][1:])
    sampled_tree = json.loads(run(*common[:-3], "--temperature", 1, "--seed", 3, "--json", "--method", "ddtree",
                                  "--drafter", tmp_path / "drafter.pt", "--rule", "reject", "--budget", 4).stdout)
    assert len(sampled_tree["ids"]) == 12 and sampled_tree["stats"]["nodes_per_round"] <= 4
    res = run("--ckpt", ckpt, "--prompt", "hi", "--method", "ddtree", "--drafter", tmp_path / "drafter.pt",
              "--min-confidence", 0.5)
    assert "--min-confidence" in res.stderr.strip().splitlines()[-1] and res.returncode != 0
    res = run("--ckpt", ckpt, "--prompt", "hi", "--method", "dflash", "--drafter", ckpt)
    assert "not a dflash drafter" in res.stderr.strip().splitlines()[-1]


def test_eagle3_chain_and_tree_equal_ar_at_temperature_zero(ckpt, tmp_path, tiny_model):
    from tinydiff.eagle3 import EagleConfig, EagleHead
    torch.manual_seed(4)
    head = EagleHead(EagleConfig.for_target(tiny_model.config), tiny_model)
    save_checkpoint(tmp_path / "head.pt", kind="eagle3", config=head.config, model=head)
    common = ["--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 12, "--temperature", 0, "--json"]
    ar = json.loads(run(*common).stdout)
    chain = json.loads(run(*common, "--method", "eagle3", "--drafter", tmp_path / "head.pt", "--k", 3).stdout)
    tree = json.loads(run(*common, "--method", "eagle3", "--drafter", tmp_path / "head.pt", "--budget", 8).stdout)
    assert chain["ids"] == tree["ids"] == ar["ids"]
    assert len(chain["stats"]["accepted"]) == 4 and tree["stats"]["nodes_per_round"] <= 8
    res = run("--ckpt", ckpt, "--prompt", "hi", "--method", "eagle3", "--drafter", ckpt)
    assert "not a eagle3 drafter" in res.stderr.strip().splitlines()[-1]


@pytest.mark.compile
def test_compile_writes_the_same_tokens_and_reports_its_time_apart(ckpt, mdlm_ckpt, tmp_path, tiny_model):
    common = ["--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 8, "--temperature", 0, "--json"]
    eager, compiled = json.loads(run(*common).stdout), json.loads(run(*common, "--compile").stdout)
    assert compiled["ids"] == eager["ids"] and compiled["stats"]["compile_seconds"] > 0
    assert "compile_seconds" not in eager["stats"]
    # DFlash and DDTree with --compile: each round one graph (fused_dflash.py), the eager tokens at T = 1 with a seed
    from tinydiff.dflash import DFlashConfig, DFlashDrafter
    config = DFlashConfig.for_target(tiny_model.config, block_size=4)
    torch.manual_seed(3)
    save_checkpoint(tmp_path / "drafter.pt", kind="dflash", config=config, model=DFlashDrafter(config, tiny_model))
    dflash = [*common[:-3], "--temperature", 1, "--seed", 5, "--json", "--method", "dflash", "--drafter",
              tmp_path / "drafter.pt"]
    eager, compiled = json.loads(run(*dflash).stdout), json.loads(run(*dflash, "--compile").stdout)
    assert compiled["ids"] == eager["ids"] and compiled["stats"]["compile_seconds"] > 0
    assert compiled["stats"]["accepted"] == eager["stats"]["accepted"]
    tree = [*dflash[:-4], "--method", "ddtree", "--drafter", tmp_path / "drafter.pt", "--budget", 4]  # fused_ddtree.py
    eager, compiled = json.loads(run(*tree).stdout), json.loads(run(*tree, "--compile").stdout)
    assert compiled["ids"] == eager["ids"] and compiled["stats"]["accepted"] == eager["stats"]["accepted"]
    spec = [*dflash[:-4], "--method", "spec", "--draft", ckpt, "--k", 3]  # fused_round.py, the draft as every id
    eager, compiled = json.loads(run(*spec).stdout), json.loads(run(*spec, "--compile").stdout)
    assert compiled["ids"] == eager["ids"] and compiled["stats"]["accepted"] == eager["stats"]["accepted"]
    for args, message in ((["--ckpt", ckpt, "--method", "ssd", "--draft", ckpt], "--compile does not apply"),
                          (["--ckpt", mdlm_ckpt], "add --cached")):
        res = run(*args, "--prompt", "hi", "--compile")
        assert res.returncode != 0 and message in res.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("args, message", [
    (["--gen-length", 10, "--block-length", 4], "multiple of the block length"),
    (["--cached", "--revise", 1], "--revise works with the uncached sampler"),
    (["--method", "ar"], "needs a ar or ar-moe checkpoint"),
    (["--gen-length", 8, "--block-length", 4, "--entropy-bound", -1], "--entropy-bound: must be a finite number >= 0"),
    (["--gen-length", 8, "--block-length", 4, "--entropy-bound", 0.5, "--threshold", 0.9], "not both"),
    (["--self-speculate", 2, "--threshold", 0.9], "one token per step exactly (cached, eager); drop --threshold"),
    (["--self-speculate", 2, "--remasking", "low_confidence"], "pass --remasking left_to_right or low_entropy"),
    (["--draft", "draft.pt"], "--draft proposes the positions of --self-speculate K for a diffusion model: add it"),
    (["--self-speculate", 2, "--draft", "draft.pt", "--remasking", "low_entropy"], "left to right, as an AR model reads"),
])
def test_diffusion_bad_input_is_one_line(mdlm_ckpt, args, message):
    res = run("--ckpt", mdlm_ckpt, "--prompt", "hi", *args)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert message in res.stderr.strip().splitlines()[-1]


def test_routing_flags_on_a_moe_checkpoint(ckpt, tmp_path):
    from tinydiff.dmoe import MoETransformer, moe_config
    torch.manual_seed(4)
    moe = MoETransformer(moe_config("draft", context=32, n_experts=8, moe_top_k=2, route_block=4))
    save_checkpoint(tmp_path / "moe.pt", kind="mdlm-moe", config=moe.config, model=moe)
    common = ["--prompt", "Once upon a time", "--gen-length", 8, "--block-length", 4, "--json"]
    saved = json.loads(run("--ckpt", tmp_path / "moe.pt", *common).stdout)["stats"]
    block = json.loads(run("--ckpt", tmp_path / "moe.pt", *common, "--routing", "block", "--route-guard", 2).stdout)
    assert saved["routing"] == "token" and block["stats"]["routing"] == "block"
    assert block["stats"]["unique_experts_per_block"] <= saved["unique_experts_per_block"]
    for path, flags, message in ((tmp_path / "moe.pt", ["--route-guard", 3], "--route-guard tunes block routing; add"),
                                 (tmp_path / "moe.pt", ["--route-mask-vote", 4], "--route-mask-vote tunes block"),
                                 (tmp_path / "moe.pt", ["--cached", "--compile"], "not cover mixture-of-experts"),
                                 (ckpt, ["--routing", "block"], "--routing do not apply to --method ar")):
        res = run("--ckpt", path, *common, *flags)
        assert res.returncode != 0 and message in res.stderr.strip().splitlines()[-1]


def test_canvas_view_redraws_in_place(capsys):
    import generate
    tok = Tokenizer()
    view = generate.CanvasView(tok, "Once", prompt_len=2)
    canvas = torch.tensor([EOT, 7454, MASK, MASK])
    view({"canvas": canvas})
    canvas[2] = 2402
    view({"canvas": canvas})
    view.clear()
    out = capsys.readouterr().out
    frames = out.split("\x1b[1F\x1b[J")  # each later frame first moves up over the one-line frame before it
    assert len(frames) == 3 and frames[-1] == ""
    assert frames[0] == "Once" + tok.decode([MASK, MASK]) + "\n" and frames[1] == "Once" + tok.decode([2402, MASK]) + "\n"
