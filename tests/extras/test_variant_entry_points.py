"""Spec: the research variants' own entry points (`python -m tinydiff.extras.<variant>`), as a user runs them:
each writes what its library function writes (lossless variants: the target's greedy text at T = 0, the cached
sampler's one-token-per-step text), its stats as the library counts them, and refuses bad input in one line."""
import json

import pytest
import torch
from entry_points import run_in_process
from hostile import NON_FINITE, refused

from tinydiff.ar import ar_generate
from tinydiff.dflash import DFlashConfig, DFlashDrafter
from tinydiff.extras import (
    ddtree_sampled,
    dflash_reject,
    drafted_diffusion,
    markov_head,
    self_correction,
    self_speculative,
)
from tinydiff.io.checkpoint import save_checkpoint
from tinydiff.sampler import generate_cached
from tinydiff.tokenizer import EOT, Tokenizer


@pytest.fixture
def drafter_ckpt(tmp_path, tiny_model):
    config = DFlashConfig.for_target(tiny_model.config, block_size=4)
    torch.manual_seed(3)
    save_checkpoint(tmp_path / "drafter.pt", kind="dflash", config=config, model=DFlashDrafter(config, tiny_model))
    return tmp_path / "drafter.pt"


def story(main, *args):
    res = run_in_process(main.main, *args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_self_speculation_and_an_ar_draft_write_the_cached_samplers_text(mdlm_ckpt, ckpt):
    from tinydiff.io.checkpoint import load_model
    mdlm, _ = load_model(mdlm_ckpt)
    prompt = [EOT] + Tokenizer().encode("Once upon a time")
    one_per_step, _ = generate_cached(mdlm, prompt, 8, 8, 4, 0.0, remasking="left_to_right")
    common = ["--ckpt", mdlm_ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 8, "--block-length", 4]
    drafted = story(self_speculative, *common, "--k", 3)  # left to right by default; greedy: the same tokens
    assert drafted["ids"] == one_per_step and drafted["stats"]["forwards"] <= 8
    assert len(drafted["stats"]["accepted"]) == 4 and drafted["stats"]["canvases"] > drafted["stats"]["forwards"]
    ar_drafted = story(drafted_diffusion, *common, "--k", 3, "--draft", ckpt)  # an AR draft proposes them
    assert ar_drafted["ids"] == one_per_step and ar_drafted["stats"]["forwards"] == ar_drafted["stats"]["rounds"]
    assert ar_drafted["stats"]["draft_forwards"] > 0 and len(ar_drafted["stats"]["accepted"]) == 4


def test_the_dflash_variants_write_the_targets_greedy_text(ckpt, drafter_ckpt):
    from tinydiff.io.checkpoint import load_model
    target, _ = load_model(ckpt)
    expected, _ = ar_generate(target, [EOT] + Tokenizer().encode("Once upon a time"), 12, temperature=0)
    common = ["--ckpt", ckpt, "--prompt", "Once upon a time", "--max-new-tokens", 12, "--temperature", 0,
              "--draft", drafter_ckpt]
    scheduled = story(dflash_reject, *common, "--rule", "reject", "--min-confidence", 0.5)
    assert scheduled["ids"] == expected  # an untrained drafter: one draft verified a round
    assert scheduled["stats"]["slot_judged"][0] > 0 and not any(scheduled["stats"]["slot_judged"][1:])
    for main, flags in ((markov_head, ["--method", "dflash"]), (markov_head, ["--method", "ddtree", "--budget", 4]),
                        (ddtree_sampled, ["--budget", 4])):  # a plain drafter: plain DFlash and DDTree at T = 0
        assert story(main, *common, *flags)["ids"] == expected
    sampled_tree = story(ddtree_sampled, *common[:6], "--temperature", 1, "--seed", 3, "--draft", drafter_ckpt,
                         "--budget", 4)
    assert len(sampled_tree["ids"]) == 12 and sampled_tree["stats"]["nodes_per_round"] <= 4


def test_self_correction_spends_its_revising_steps(mdlm_ckpt):
    out = story(self_correction, "--ckpt", mdlm_ckpt, "--prompt", "Once", "--max-new-tokens", 8, "--block-length", 4,
                "--steps", 4, "--revise", 2)
    assert len(out["ids"]) == 8 and out["stats"]["forwards"] == 4 + 2 * 2  # two blocks, two revisions each


NUMBERS = {self_speculative: {"--k": ["0", "-1"], "--block-length": ["0"]},
           drafted_diffusion: {"--k": ["0"]},
           self_correction: {"--revise": ["-1", "1.5"], "--steps": ["0"]},
           dflash_reject: {"--min-confidence": ["-0.1", "1.5"], "--k": ["0"]},
           ddtree_sampled: {"--budget": ["0", "-2"], "--k": ["0"]},
           markov_head: {"--budget": ["0"], "--k": ["-1"]}}
CASES = [(main, flag, value) for main, flags in NUMBERS.items() for flag, values in flags.items()
         for value in [*values, *NON_FINITE]]


@pytest.mark.parametrize("main, flag, value", CASES, ids=lambda v: v.__name__.split(".")[-1] if hasattr(v, "main")
                         else str(v))
def test_every_bad_number_is_refused_at_the_command_line(ckpt, tmp_path, capsys, main, flag, value):
    argv = ["--ckpt", ckpt, "--prompt", "hi", flag, value]
    if main in (dflash_reject, ddtree_sampled, markov_head, drafted_diffusion):
        argv += ["--draft", ckpt]
    assert f"argument {flag}:" in refused(main.main, argv, capsys, tmp_path)


def test_a_wrong_checkpoint_or_order_is_one_line(ckpt, mdlm_ckpt, tmp_path, capsys):
    for main, argv, message in (
            (self_speculative, ["--ckpt", ckpt], "this needs mdlm or mdlm-moe"),
            (self_speculative, ["--ckpt", mdlm_ckpt, "--order", "low_confidence"], "invalid choice"),
            (dflash_reject, ["--ckpt", ckpt, "--draft", ckpt], "holds a ar model; this needs dflash"),
            (drafted_diffusion, ["--ckpt", mdlm_ckpt, "--draft", mdlm_ckpt], "this needs ar"),
            (markov_head, ["--ckpt", ckpt, "--draft", ckpt, "--budget", "8"], "--budget sizes DDTree's tree")):
        assert message in refused(main.main, [*argv, "--prompt", "hi"], capsys, tmp_path)
