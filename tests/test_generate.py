"""Spec: generate.py as a user runs it: JSON output, every core method through it, and one-line errors
(the research variants' own entry points: tests/extras/; the bench: tests/bench/test_bench.py)."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from entry_points import run_in_process

import generate
from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.model import Transformer
from tinydiff.sampler import diffusion_lengths
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
    res = run("--ckpt", mdlm_ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 8, "--block-length", 4,
              "--steps", 4, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert len(out["ids"]) == 8 and MASK not in out["ids"]
    assert out["stats"]["forwards"] == 4 and out["stats"]["tokens_per_forward"] == 2
    res = run("--ckpt", mdlm_ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 8, "--block-length", 4,
              "--method", "diffusion-cached", "--entropy-bound", "1e9", "--json")  # a bound nothing reaches
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["stats"]["forwards"] == 2  # each block in one forward
    res = run("--ckpt", mdlm_ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 16, "--json")
    assert res.returncode == 0 and len(json.loads(res.stdout)["ids"]) == 16  # a block of 16, not 32: not refused


def test_the_default_block_divides_the_canvas_the_user_asked_for():
    """--block-length's default is 32, or the largest size under it that divides --max-new-tokens (the whole
    canvas where none of 8..32 does): 40 new tokens were refused as "not a multiple of the block length 32",
    a block the user never set. A block the user gives stays theirs (and is checked by the sampler)."""
    model = SimpleNamespace(config=SimpleNamespace(context=256))
    assert [diffusion_lengths(model, [1], n, None) for n in (64, 40, 16, 37, 100)] == \
        [(64, 32), (40, 20), (16, 16), (37, 37), (100, 25)]
    assert diffusion_lengths(model, [1] * 200, None, None) == (32, 32) and diffusion_lengths(model, [1], 40, 8) == (40, 8)


def test_spec_equals_ar_at_temperature_zero(ckpt, tmp_path, tiny_config):
    draft_config = type(tiny_config)(**{**tiny_config.__dict__, "n_layer": 1})
    torch.manual_seed(2)
    save_checkpoint(tmp_path / "draft.pt", kind="ar", config=draft_config, model=Transformer(draft_config))
    common = ["--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 12, "--temperature", 0, "--json"]
    ar = json.loads(run(*common).stdout)
    spec = json.loads(run(*common, "--method", "spec", "--draft", tmp_path / "draft.pt", "--k", 3).stdout)
    vllm = '{"method": "draft_model", "model": "%s", "num_speculative_tokens": 2}' % (tmp_path / "draft.pt")
    via_config = json.loads(run(*common, "--speculative-config", vllm).stdout)
    ssd = json.loads(run(*common, "--method", "ssd", "--draft", tmp_path / "draft.pt", "--k", 3).stdout)
    assert spec["ids"] == ar["ids"] == via_config["ids"] == ssd["ids"]
    assert spec["stats"]["forwards"] == spec["stats"]["rounds"] and len(spec["stats"]["accepted"]) == 4
    assert ssd["stats"]["accepted"] == spec["stats"]["accepted"] and sum(ssd["stats"]["lookups"]) > 0
    assert len(via_config["stats"]["accepted"]) == 3
    res = run(*common, "--speculative-config", vllm, "--draft", tmp_path / "draft.pt")  # two drafts named
    assert res.returncode != 0 and "drop --draft" in res.stderr.strip().splitlines()[-1]
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
    dflash = json.loads(run(*common, "--method", "dflash", "--draft", tmp_path / "drafter.pt").stdout)
    vllm = '{"method": "dflash", "model": "%s", "num_speculative_tokens": 2}' % (tmp_path / "drafter.pt")
    via_config = json.loads(run(*common, "--speculative-config", vllm).stdout)
    tree = json.loads(run(*common, "--method", "ddtree", "--draft", tmp_path / "drafter.pt", "--budget", 4).stdout)
    assert dflash["ids"] == ar["ids"] == via_config["ids"] == tree["ids"]
    assert len(dflash["stats"]["accepted"]) == 4 and len(via_config["stats"]["accepted"]) == 3
    assert tree["stats"]["nodes_per_round"] <= 4
    res = run("--ckpt", ckpt, "--prompt", "hi", "--method", "ddtree", "--draft", tmp_path / "drafter.pt",
              "--min-confidence", 0.5)  # a variant's flag (python -m tinydiff.extras.dflash_reject)
    assert "--min-confidence" in res.stderr.strip().splitlines()[-1] and res.returncode != 0
    res = run("--ckpt", ckpt, "--prompt", "hi", "--method", "dflash", "--draft", ckpt)
    assert "holds a ar model; this needs dflash" in res.stderr.strip().splitlines()[-1]


def test_eagle3_chain_and_tree_equal_ar_at_temperature_zero(ckpt, tmp_path, tiny_model):
    from tinydiff.eagle3 import EagleConfig, EagleHead
    torch.manual_seed(4)
    head = EagleHead(EagleConfig.for_target(tiny_model.config), tiny_model)
    save_checkpoint(tmp_path / "head.pt", kind="eagle3", config=head.config, model=head)
    common = ["--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 12, "--temperature", 0, "--json"]
    ar = json.loads(run(*common).stdout)
    chain = json.loads(run(*common, "--method", "eagle3", "--draft", tmp_path / "head.pt", "--k", 3).stdout)
    tree = json.loads(run(*common, "--method", "eagle3", "--draft", tmp_path / "head.pt", "--budget", 8).stdout)
    assert chain["ids"] == tree["ids"] == ar["ids"]
    assert len(chain["stats"]["accepted"]) == 4 and tree["stats"]["nodes_per_round"] <= 8
    res = run("--ckpt", ckpt, "--prompt", "hi", "--method", "eagle3", "--draft", ckpt)
    assert "holds a ar model; this needs eagle3" in res.stderr.strip().splitlines()[-1]


@pytest.mark.compile
def test_compile_writes_the_same_tokens_and_reports_its_time_apart(ckpt, mdlm_ckpt, tmp_path, tiny_model):
    """--compile compiles the steps of the very loops generate.py runs eagerly: the same tokens and counts."""
    common = ["--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 8, "--temperature", 0, "--json"]
    eager, compiled = json.loads(run(*common).stdout), json.loads(run(*common, "--compile").stdout)
    assert compiled["ids"] == eager["ids"] and compiled["stats"]["compile_seconds"] > 0
    assert "compile_seconds" not in eager["stats"]
    from tinydiff.dflash import DFlashConfig, DFlashDrafter
    config = DFlashConfig.for_target(tiny_model.config, block_size=4)
    torch.manual_seed(3)
    save_checkpoint(tmp_path / "drafter.pt", kind="dflash", config=config, model=DFlashDrafter(config, tiny_model))
    dflash = [*common[:-3], "--temperature", 1, "--seed", 5, "--json", "--method", "dflash", "--draft",
              tmp_path / "drafter.pt"]  # DFlash at T = 1 with a seed: the eager tokens
    eager, compiled = json.loads(run(*dflash).stdout), json.loads(run(*dflash, "--compile").stdout)
    assert compiled["ids"] == eager["ids"] and compiled["stats"]["compile_seconds"] > 0
    assert compiled["stats"]["accepted"] == eager["stats"]["accepted"]
    tree = [*dflash[:-4], "--method", "ddtree", "--draft", tmp_path / "drafter.pt", "--budget", 4]
    eager, compiled = json.loads(run(*tree).stdout), json.loads(run(*tree, "--compile").stdout)
    assert compiled["ids"] == eager["ids"] and compiled["stats"]["accepted"] == eager["stats"]["accepted"]
    spec = [*dflash[:-4], "--method", "spec", "--draft", ckpt, "--k", 3]
    eager, compiled = json.loads(run(*spec).stdout), json.loads(run(*spec, "--compile").stdout)
    assert compiled["ids"] == eager["ids"] and compiled["stats"]["accepted"] == eager["stats"]["accepted"]
    cached = ["--ckpt", mdlm_ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 8, "--block-length", 4,
              "--method", "diffusion-cached", "--json"]
    eager, compiled = json.loads(run(*cached).stdout), json.loads(run(*cached, "--compile").stdout)
    assert compiled["ids"] == eager["ids"] and compiled["stats"]["forwards"] == eager["stats"]["forwards"]
    for args, message in ((["--ckpt", ckpt, "--method", "ssd", "--draft", ckpt], "--compile does not apply"),
                          (["--ckpt", mdlm_ckpt], "--compile does not apply to --method diffusion")):
        res = run(*args, "--prompt", "hi", "--compile")
        assert res.returncode != 0 and message in res.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", 10, "--block-length", 4], "multiple of the block length"),
    (["--method", "ar"], "needs a ar or ar-moe checkpoint"),
    (["--max-new-tokens", 8, "--block-length", 4, "--entropy-bound", -1], "--entropy-bound: must be a finite number >= 0"),
    (["--max-new-tokens", 8, "--block-length", 4, "--entropy-bound", 0.5, "--threshold", 0.9], "not both"),
    (["--draft", "draft.pt"], "--draft does not apply to --method diffusion"),
    (["--revise", 1], "unrecognized arguments: --revise"),  # a variant's: python -m tinydiff.extras.self_correction
])
def test_diffusion_bad_input_is_one_line(mdlm_ckpt, args, message):
    res = run("--ckpt", mdlm_ckpt, "--prompt", "hi", *args)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert message in res.stderr.strip().splitlines()[-1]


def test_a_moe_checkpoint_decodes_with_its_saved_routing(ckpt, tmp_path):
    """The same weights saved token- and block-routed: each decodes with its own routing (switching it at decode
    time is the quality tool's --routing; train.py --init CKPT --routing block converts a checkpoint)."""
    from tinydiff.dmoe import MoETransformer, moe_config, set_routing
    torch.manual_seed(4)
    moe = MoETransformer(moe_config("draft", context=32, n_experts=8, moe_top_k=2, route_block=4, route_guard=2))
    save_checkpoint(tmp_path / "moe.pt", kind="mdlm-moe", config=moe.config, model=moe)
    set_routing(moe, "block")
    save_checkpoint(tmp_path / "block.pt", kind="mdlm-moe", config=moe.config, model=moe)
    common = ["--prompt", "Once upon a time", "--max-new-tokens", 8, "--block-length", 4, "--json"]
    saved = json.loads(run("--ckpt", tmp_path / "moe.pt", *common).stdout)["stats"]
    block = json.loads(run("--ckpt", tmp_path / "block.pt", *common).stdout)
    assert saved["routing"] == "token" and block["stats"]["routing"] == "block"
    assert block["stats"]["unique_experts_per_block"] <= saved["unique_experts_per_block"]
    for path, flags, message in ((tmp_path / "moe.pt", ["--route-guard", 3], "unrecognized arguments: --route-guard"),
                                 (tmp_path / "moe.pt", ["--routing", "block"], "unrecognized arguments: --routing"),
                                 (tmp_path / "moe.pt", ["--method", "diffusion-cached", "--compile"],
                                  "not cover mixture-of-experts"),
                                 (ckpt, ["--threshold", 0.9], "--threshold do not apply to --method ar")):
        res = run("--ckpt", path, *common, *flags)
        assert res.returncode != 0 and message in res.stderr.strip().splitlines()[-1]


def test_canvas_view_redraws_in_place(capsys):
    from tinydiff.tools.replay import CanvasView
    tok = Tokenizer()
    view = CanvasView(tok, "Once", prompt_len=2)
    canvas = torch.tensor([EOT, 7454, MASK, MASK])
    view({"canvas": canvas})
    canvas[2] = 2402
    view({"canvas": canvas})
    view.clear()
    out = capsys.readouterr().out
    frames = out.split("\x1b[1F\x1b[J")  # each later frame first moves up over the one-line frame before it
    assert len(frames) == 3 and frames[-1] == ""
    assert frames[0] == "Once" + tok.decode([MASK, MASK]) + "\n" and frames[1] == "Once" + tok.decode([2402, MASK]) + "\n"
