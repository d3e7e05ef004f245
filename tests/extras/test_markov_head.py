"""Spec: DSpark's Markov head on a DFlash drafter (tinydiff/extras/markov_head.py). With W2 = 0 (a new head)
it is exactly plain DFlash, in training and decoding; its drafts at T = 0 are the argmax chain of
the biased logits; every rule stays lossless (greedy equality, chi-square at T > 0); the training
loss reads the text's previous token; --markov-rank is checked and recorded."""
import pytest
import torch
from dflash_models import dflash_with_rule as dflash_generate
from stats_helpers import (
    DFLASH_DIST_CONFIG,
    NEW,
    PROMPT,
    assert_follows_the_joint,
    exact_joint,
    float64,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread)
    random_drafter,
    random_model,
    sample_counts,
)
from table_models import TableTarget

import train
from tinydiff.ar import ar_generate
from tinydiff.checks import UserError
from tinydiff.dflash import dflash_loss
from tinydiff.extras.markov_head import markov_ddtree_generate, markov_drafts, markov_loss
from tinydiff.io.checkpoint import load_checkpoint, save_checkpoint
from tinydiff.model import ModelConfig
from tinydiff.sampling import next_token_probs
from tinydiff.tokenizer import EOT, MASK


@pytest.fixture(scope="module")
def models():
    target = random_model(ModelConfig(context=40, n_layer=5, n_head=2, d_model=32, d_ff=64), seed=0)
    plain = random_drafter(target, seed=1, n_layer=2, block_size=8, n_features=2)
    markov = random_drafter(target, seed=1, n_layer=2, block_size=8, n_features=2, markov_rank=4)
    return float64(target, plain, markov)  # two code paths compared: float64 rounding only


def same_but_zero_head(plain, markov):
    """The Markov drafter holding the plain one's weights, its W2 zeroed: plain DFlash by construction."""
    markov.load_state_dict({**markov.state_dict(), **plain.state_dict()})
    markov.markov.zero_()
    return markov


def test_a_zero_head_is_exactly_plain_dflash(models):
    target, plain, markov = models
    zero = same_but_zero_head(plain, markov)
    windows = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(3))
    assert torch.equal(dflash_loss(plain, windows, torch.Generator().manual_seed(4))[0],
                       markov_loss(zero, windows, torch.Generator().manual_seed(4))[0])
    prompt = [EOT, 464, 3290]
    for rule, temperature in (("match", 0.0), ("match", 1.0), ("reject", 1.0)):
        ours, theirs = (dflash_generate(target, d, prompt, 20, temperature=temperature, rule=rule, stop_token=None,
                                        generator=torch.Generator().manual_seed(5))[0] for d in (plain, zero))
        assert ours == theirs, (rule, temperature)


def test_greedy_drafts_are_the_argmax_chain_of_the_biased_logits_and_the_output_is_greedy_target(models):
    target, _, markov = models
    torch.manual_seed(6)
    with torch.no_grad():
        markov.markov.up.weight.normal_(0, 2.0)  # a bias large enough to move the argmax
    logits = torch.randn(7, target.config.vocab_size, dtype=torch.float64)  # a block's 7 slots
    previous, chain, rows = 464, [], []
    for row in logits:  # the chain by hand: each slot biased by the token picked before it
        row = row + markov.markov(torch.tensor(previous))
        previous = int(row[:MASK].argmax())
        chain.append(previous)
        rows.append(row)
    drafts, q = markov_drafts(markov, logits, 464, (0.0, None, None))
    assert drafts.tolist() == chain and q is None and chain != logits[:, :MASK].argmax(-1).tolist()
    sampled, q = markov_drafts(markov, logits, 464, (0.0, None, None), sampled=True)  # "reject" at T = 0
    assert sampled.tolist() == chain and torch.equal(q, next_token_probs(torch.stack(rows), 0.0))
    prompt = [EOT, 464]
    greedy = ar_generate(target, prompt, 24, temperature=0, stop_token=None)[0]
    for rule in ("match", "reject"):  # lossless at T = 0: the target's greedy text
        assert dflash_generate(target, markov, prompt, 24, temperature=0, stop_token=None, rule=rule)[0] == greedy
    assert markov_ddtree_generate(target, markov, prompt, 24, budget=6, temperature=0, stop_token=None)[0] == greedy


@pytest.mark.parametrize("rule", ["match", "reject"])
@torch.no_grad()
def test_a_markov_drafter_keeps_every_rule_lossless(rule):
    """test_dflash's chi-square design (significance 1e-3, power asserted from the joint) with a
    random drafter whose Markov head is random too."""
    target = random_model(DFLASH_DIST_CONFIG, seed=1, embed_std=0.1)
    drafter = random_drafter(target, seed=5, block_size=4, markov_rank=3)
    probs, n = exact_joint(target, 1.0, None, None), 5_500
    target = TableTarget(target, drafter.config.taps)  # the same answers, looked up: a fraction of the time
    counts, hist = sample_counts(lambda generator: dflash_generate(
        target, drafter, PROMPT, NEW, None, 1.0, None, None, generator, stop_token=None, rule=rule), n, None, 1234)
    assert hist[0] > 0 and hist[NEW - 1] > 0, hist  # rejections and full acceptances, or it proves nothing
    assert_follows_the_joint(probs, counts, n)


def test_training_biases_each_slot_by_the_texts_previous_token(models):
    _, plain, markov = models
    zero = same_but_zero_head(plain, markov)
    with torch.no_grad():
        zero.markov.up.weight.normal_(0, 1.0)
    windows = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(7))
    loss, _ = markov_loss(zero, windows, torch.Generator().manual_seed(8))
    assert not torch.equal(loss, dflash_loss(plain, windows, torch.Generator().manual_seed(8))[0])
    loss.backward()
    assert zero.markov.up.weight.grad.abs().sum() > 0 and zero.markov.down.weight.grad.abs().sum() > 0
    rows = zero.markov.down.weight.grad.abs().sum(-1).nonzero().flatten().tolist()
    assert set(rows) <= set(windows[:, :-1].flatten().tolist())  # only tokens of the text feed the bias


def test_train_markov_rank_is_recorded_and_checked(story_file, tmp_path, tiny_model, tiny_config):
    save_checkpoint(tmp_path / "target.pt", kind="ar", config=tiny_config, model=tiny_model)
    common = ["--target", str(tmp_path / "target.pt"), "--data", str(story_file), "--batch-size", "2",
              "--max-steps", "1", "--warmup", "1", "--eval-every", "1", "--eval-batches", "1", "--device", "cpu"]
    train.main(["--model", "dflash", "--block-size", "4", "--markov-rank", "3", *common, "--out", str(tmp_path / "d")])
    ckpt = load_checkpoint(tmp_path / "d" / "ckpt.pt")
    assert ckpt["config"]["markov_rank"] == 3 and ckpt["model"]["markov.up.weight"].shape == (tiny_config.vocab_size, 3)
    with pytest.raises(UserError, match="--markov-rank apply to --model dflash only"):
        train.main(["--model", "eagle3", "--markov-rank", "3", *common, "--out", str(tmp_path / "e")])
    assert not (tmp_path / "e").exists()
