"""Spec: self-correction (tinydiff/extras/self_correction.py). After a block is full, each revising step
re-masks the block's least confident token and predicts it again: only the revised tokens change, the
prompt never does; revise = 0 is the LLaDA sampler (sampler.generate) token for token."""
import pytest
import torch

from tinydiff.checks import UserError
from tinydiff.extras.self_correction import generate_revising
from tinydiff.model import ModelConfig, Transformer
from tinydiff.sampler import generate
from tinydiff.tokenizer import MASK

PROMPT = [50256, 464, 3797, 318]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(context=64, n_layer=2, n_head=2, d_model=32, d_ff=64, causal=False)).eval()


def test_self_correction_changes_only_the_revised_tokens(model):
    events = []
    ids, stats = generate_revising(model, PROMPT, gen_length=16, steps=8, block_length=8, revise=3, temperature=1.0,
                                   generator=torch.Generator().manual_seed(4), callback=events.append)
    before = [torch.tensor(PROMPT + [MASK] * 16)] + [e["canvas"] for e in events[:-1]]
    revisions = 0
    for before, event in zip(before, events):
        revised = event.get("revised", [])
        changed = (before != event["canvas"]).nonzero().flatten().tolist()
        overwritten = [p for p in changed if before[p] != MASK]
        assert set(overwritten) <= set(revised)
        assert (event["canvas"][:len(PROMPT)] == torch.tensor(PROMPT)).all()
        if revised:
            revisions += 1
            assert event["committed"] == revised  # re-masked, then predicted again
    assert revisions == 2 * 3 and stats.forwards == 8 + 2 * 3 and MASK not in ids


def test_no_revision_is_the_llada_sampler(model):
    for temperature in (0.0, 1.0):
        ours = generate_revising(model, PROMPT, 16, 8, 8, 0, temperature, generator=torch.Generator().manual_seed(5))
        theirs = generate(model, PROMPT, 16, 8, 8, temperature, generator=torch.Generator().manual_seed(5))
        assert ours[0] == theirs[0] and ours[1].forwards == theirs[1].forwards
    with pytest.raises(UserError, match="revise must be an integer >= 0"):
        generate_revising(model, PROMPT, 16, 8, 8, -1)
