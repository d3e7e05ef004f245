"""Spec: tinydiff/train/run_config.py. Each run setting is declared once: every RunConfig field is one
train.py flag that stays unset unless given, new runs take the fields' defaults, and bad values fail
at construction with a one-line error."""
import math

import pytest

import train
from tinydiff.checks import UserError
from tinydiff.train.run_config import KINDS, SETTINGS, RunConfig, given_settings, migrate, new_run


def test_every_setting_is_one_flag_unset_unless_given_and_every_kind_has_an_objective():
    args = train.parse_args([])
    assert all(getattr(args, key) is None for key in SETTINGS) and given_settings(args) == {}
    args = train.parse_args(["--lr", "0.5", "--feature-layers", "1,3", "--model", "ar"])
    assert given_settings(args) == {"lr": 0.5, "feature_layers": [1, 3], "model": "ar"}
    assert set(train.LOSSES) == set(KINDS)


def test_the_flag_vocabularies_written_here_are_the_methods_own():
    """run_config.py writes the vocabularies of the MoE, FP4, the samplers and distillation, so that an AR run
    imports none of them (test_train.py's test of what a run loads): each must be its method's own."""
    from tinydiff import dmoe, fp4, sampler
    from tinydiff.extras import distill
    from tinydiff.train import run_config
    assert run_config.EXPERTS == dmoe.EXPERTS and run_config.FP4_FORMATS == fp4.FORMATS
    assert run_config.REMASKING == sampler.REMASKING and run_config.DISTILL_LOSSES == distill.LOSSES


def test_a_new_run_is_the_defaults_with_the_flags_given():
    run = new_run(train.parse_args(["--lr", "0.5"]), preset="tiny")
    assert set(run) == set(SETTINGS) and run["preset"] == "tiny" and run["min_lr"] == 0.05
    assert {k: v for k, v in run.items() if k not in ("lr", "min_lr", "preset")} == \
        {k: v for k, v in migrate({}, "x").items() if k not in ("lr", "min_lr", "preset")}


def test_a_new_runs_length_is_its_presets_unless_given():
    # 13m, a GPU's default: about an hour on a free T4; every other run (a CPU's tiny, a borrowed shape) 5,000 x 32
    assert {k: new_run(train.parse_args([]), preset="13m")[k] for k in ("max_steps", "batch_size")} == \
        {"max_steps": 30000, "batch_size": 64}
    assert {k: new_run(train.parse_args([]), preset="tiny")[k] for k in ("max_steps", "batch_size")} == \
        {"max_steps": 5000, "batch_size": 32}
    run = new_run(train.parse_args(["--max-steps", "7", "--batch-size", "3"]), preset="13m")
    assert (run["max_steps"], run["batch_size"]) == (7, 3)
    run = new_run(train.parse_args(["--init", "x.pt"]), preset="13m")  # the shape is the checkpoint's
    assert run["preset"] is None and (run["max_steps"], run["batch_size"]) == (5000, 32)


@pytest.mark.parametrize("setting, value, message", [
    ("max_steps", 0, "--max-steps must be an integer >= 1"), ("batch_size", -1, "--batch-size must be an integer >= 1"),
    ("lr", math.nan, "--lr must be a finite number"), ("grad_clip", -1.0, "--grad-clip must be a finite"),
    ("weight_decay", math.inf, "--weight-decay must be a finite"), ("anchor_weight", 1.0, "tune --distill"),
    ("openings", "target", "add --regenerate N"),
])
def test_bad_settings_fail_at_construction(setting, value, message):
    with pytest.raises(UserError, match=message):
        RunConfig(**{setting: value})
