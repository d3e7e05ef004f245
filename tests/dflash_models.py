"""The DFlash tests' models: the module-scoped target + drafter fixtures (GPT-2's full vocabulary and
MASK, in float32 and float64), targets a drafter was not built for, and `run`, dflash_generate with
every round recorded. Not a test file: the DFlash tests import from it.
"""
from functools import partial

import pytest
from stats_helpers import float64, random_drafter, random_model, recorded_run

from tinydiff.dflash import dflash_generate
from tinydiff.extras.dflash_reject import dflash_reject_generate
from tinydiff.extras.markov_head import markov_drafts
from tinydiff.model import ModelConfig

# Targets of another shape than `models`' target: another vocabulary, width, depth or context.
MISMATCHED_TARGETS = (ModelConfig(vocab_size=1000, context=40, n_layer=5, n_head=2, d_model=32, d_ff=64),
                      ModelConfig(context=40, n_layer=5, n_head=2, d_model=16, d_ff=64),
                      ModelConfig(context=40, n_layer=6, n_head=2, d_model=32, d_ff=64),
                      ModelConfig(context=64, n_layer=5, n_head=2, d_model=32, d_ff=64))


def dflash_with_rule(target, drafter, *args, rule="match", **kwargs):
    """DFlash with `rule` (extras/dflash_reject.py: "match", "reject"; min_confidence too), a Markov drafter's
    drafts read through its head (extras/markov_head.py)."""
    propose = partial(markov_drafts, sampled=rule == "reject") if getattr(drafter, "markov", None) is not None \
        else None
    return dflash_reject_generate(target, drafter, *args, rule=rule, propose=propose, **kwargs)


def run(target, drafter, prompt, n, oracle=None, on_round=None, **kwargs):
    """dflash_generate with every round's info recorded (caches left out), also passed to the oracle
    and to on_round; with a `rule`, extras/dflash_reject.py's (rule="match" is dflash_generate's own)."""
    decode = dflash_with_rule if "rule" in kwargs or "min_confidence" in kwargs else dflash_generate
    return recorded_run(decode, target, drafter, prompt, n, oracle, on_round, **kwargs)


# Models with GPT-2's full vocabulary (and MASK). Five target layers: two feature layers, [1, 2].
@pytest.fixture(scope="module")
def models():
    target = random_model(ModelConfig(context=40, n_layer=5, n_head=2, d_model=32, d_ff=64), seed=0)
    return target, random_drafter(target, seed=1, n_layer=2, block_size=8, n_features=2)


@pytest.fixture(scope="module")
def models64(models):  # the same in float64: tests that compare two code paths hold them to float64 rounding
    return float64(*models)
