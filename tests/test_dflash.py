"""Spec: a DFlash drafter drafts a block in one pass and is trained on exactly what it sees at inference.

The layer-id rule; the drafter borrows the target frozen; the block is [committed token, MASK...];
the packed multi-anchor training forward equals the inference path and the loss weights/labels are
the documented ones; a drafter for another target, or a damaged config, is a clear error.
Decoding with it: test_dflash_decode.py.
"""
import itertools
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F
from dflash_models import MISMATCHED_TARGETS, models, models64, run  # noqa: F401 (fixtures)
from stats_helpers import (
    EXACT,
    assert_same,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread)
    random_drafter,
    random_model,
)

from tinydiff.checks import UserError
from tinydiff import dflash
from tinydiff.dflash import (
    DFlashConfig,
    DFlashDrafter,
    block_input,
    block_loss,
    default_decay,
    dflash_generate,
    dflash_loss,
    draft_block,
    feature_layers,
    packed_logits,
    sample_anchors,
    training_mask,
)
from tinydiff.io.checkpoint import drafter_from
from tinydiff.model import ModelConfig
from tinydiff.tokenizer import EOT, MASK


def test_feature_layer_rule():
    assert feature_layers(36, 5) == [1, 9, 17, 25, 33] and feature_layers(8, 2) == [1, 5]
    assert feature_layers(36, 1) == [18] and feature_layers(8, 1) == [4] and feature_layers(4, 1) == [2]
    for L, N in itertools.product(range(5, 40), range(2, 8)):
        if N <= L - 3:
            ids = feature_layers(L, N)  # evenly spaced from 1 to L-3: ends fixed, gaps differ by <= 1
            gaps = [b - a for a, b in zip(ids, ids[1:])]
            assert len(ids) == N and ids[0] == 1 and ids[-1] == L - 3 and max(gaps) - min(gaps) <= 1 and min(gaps) >= 1
        else:
            with pytest.raises(UserError, match="n_features"):
                feature_layers(L, N)
    assert DFlashConfig.for_target(ModelConfig(n_layer=8)).feature_layers == [1, 2, 3, 4, 5]
    assert DFlashConfig.for_target(ModelConfig(n_layer=4)).feature_layers == [2]
    assert [default_decay(b) for b in (16, 10, 8)] == [7, 5, 4]
    assert DFlashConfig(block_size=16).loss_decay == 7 and DFlashConfig(block_size=8).loss_decay == 4


def test_drafter_borrows_the_target_frozen(models):
    target, drafter = models
    assert not any(k.startswith(("target", "embed")) for k in drafter.state_dict())
    assert "mask_embed" in drafter.state_dict()  # the MASK slots' input is the drafter's own
    assert not {id(p) for p in drafter.parameters()} & {id(p) for p in target.parameters()}
    assert all(p.requires_grad for p in target.parameters())  # frozen by detach, not by a flag
    windows = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(0))
    loss, stats = dflash_loss(drafter, windows, torch.Generator().manual_seed(0))
    loss.backward()
    assert all(p.grad is None for p in target.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    drafter.zero_grad(set_to_none=True)
    assert set(stats) >= {"ce", "acc"} and all(float(v) == float(v) for v in stats.values())
    # The checkpoint plan: config as a dict, the drafter's state dict; rebuilt, it drafts the same.
    rebuilt = drafter_from({"config": asdict(drafter.config), "model": drafter.state_dict()}, target)
    cache_a, cache_b = drafter.new_cache(), rebuilt.new_cache()
    _, hidden = target(torch.tensor([[1, 2, 3]]), causal=True, hidden_layers=drafter.config.taps)
    with torch.no_grad():
        assert torch.equal(draft_block(drafter, cache_a, 4, hidden), draft_block(rebuilt, cache_b, 4, hidden))


@torch.no_grad()
def test_a_feature_layer_id_is_the_output_of_that_0_indexed_block(models):
    """docs/DESIGN.md's rule (z-lab/dflash reads hidden_states[id + 1]): id i reads what target block
    i writes. Hooks catch the blocks' outputs and the drafter's projection input in one decode."""
    target, drafter = models
    ids = drafter.config.feature_layers
    assert ids == [1, 2] and drafter.config.taps == [2, 3]
    outputs, seen = {}, []

    def keep_first(i):
        def hook(module, args, out):  # returns None: a hook that returns a value replaces the output
            outputs.setdefault(i, out)
        return hook

    hooks = [target.blocks[i].register_forward_hook(keep_first(i)) for i in ids]
    hooks.append(drafter.fc.register_forward_pre_hook(lambda m, a: seen.append(a[0])))
    try:
        dflash_generate(target, drafter, [EOT, 11, 12, 13], 2, temperature=0, stop_token=None)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(seen[0], torch.cat([outputs[i] for i in ids], -1))  # the prefill's features


@torch.no_grad()
def test_a_drafter_saved_before_feature_ids_keeps_reading_its_layers(models):
    """A version 1 checkpoint without the field (or any with feature_ids "after_blocks") meant "after i blocks":
    it loads with its ids read one block earlier, so it reads exactly the hidden states it was trained on."""
    target, _ = models
    new = random_drafter(target, seed=1, n_layer=1, block_size=8, n_features=2)
    assert new.config.feature_layers == [1, 2] and new.config.taps == [2, 3]
    old = {**asdict(new.config), "feature_layers": [2, 3]}  # the same layers, as an old drafter named them
    for stored, version in ((old, 1), ({**old, "feature_ids": "after_blocks"}, 2),
                            ({**asdict(new.config), "feature_ids": "block_output"}, 1), (asdict(new.config), 2)):
        rebuilt = drafter_from({"version": version, "config": stored, "model": new.state_dict()}, target)
        assert rebuilt.config.feature_layers == [1, 2] and rebuilt.config.taps == [2, 3]
    prompt = [EOT, 11, 12, 13]
    assert dflash_generate(target, rebuilt, prompt, 12, temperature=0, stop_token=None)[0] == \
        dflash_generate(target, new, prompt, 12, temperature=0, stop_token=None)[0]
    for bad, message in (({**old, "feature_ids": "after"}, "feature_ids"), ({**old, "feature_layers": [0, 2]},
                                                                            "reads the target's embeddings")):
        with pytest.raises(UserError, match=message):
            drafter_from({"version": 1, "config": bad, "model": new.state_dict()}, target)
    with pytest.raises(UserError, match="<= 4, got 5"):
        DFlashConfig.for_target(target.config, feature_layers=[1, 5])


@torch.no_grad()
def test_block_is_the_committed_token_then_masks(models):
    target, drafter = models
    assert block_input(123, 5).tolist() == [[123, MASK, MASK, MASK, MASK]]
    seen, seqs = [], []
    handle = drafter.register_forward_pre_hook(
        lambda module, args: seen.append((args[0][0].tolist(), args[1].tolist())))  # (block ids, positions)
    try:
        prompt = [EOT, 5, 6]
        run(target, drafter, prompt, 12, temperature=1.0, generator=torch.Generator().manual_seed(0),
            stop_token=None, on_round=lambda info: seqs.append(info["seq"]))
    finally:
        handle.remove()
    before = [prompt] + seqs[:-1]  # the committed sequence at the start of each round
    assert len(seen) >= 2
    for (block, pos), seq in zip(seen, before):
        assert block == [seq[-1]] + [MASK] * 7 and pos == list(range(len(seq) - 1, len(seq) + 7))


@torch.no_grad()
def test_packed_training_forward_equals_the_inference_path(models64):
    """One packed forward of many overlapping blocks gives, for each block, the logits draft_block
    computes from a cache filled with the features of the tokens before its anchor alone (in float64:
    to float64 rounding)."""
    target, drafter = models64
    B, T = drafter.config.block_size, 24
    windows = torch.randint(0, 50257, (2, T), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[1, 5, 6, T - B], [9, 3, 2, 10]])  # overlapping blocks, both ends
    packed, _ = packed_logits(drafter, windows, anchors)  # (2, 4, B-1, V)
    for b, j in itertools.product(range(2), range(4)):
        a = int(anchors[b, j])
        _, hidden = target(windows[b:b + 1, :a], causal=True, hidden_layers=drafter.config.taps)
        alone = draft_block(drafter, drafter.new_cache(), int(windows[b, a]), hidden)  # (B-1, V)
        assert_same(packed[b, j], alone)
    mask = training_mask(anchors, B, T)[0]  # rows of block j: context before its anchor, and itself
    for j, a in enumerate(anchors[0].tolist()):
        row = mask[j * B]
        assert row[:T].tolist() == [c < a for c in range(T)]
        assert row[T:].tolist() == [j * B <= c < (j + 1) * B for c in range(4 * B)]
        assert (mask[j * B:(j + 1) * B] == row).all()


@torch.no_grad()
def test_loss_labels_weights_and_anchors(models64):
    """The loss is sum_k exp(-(k-1)/g) CE(slot k, token at anchor + k) / sum_k exp(-(k-1)/g), averaged
    over blocks, each computed here through the inference path (MASK's logit left out; in float64: to
    float64 rounding); anchors are distinct in [1, T-B]."""
    target, drafter = models64
    B, g, T = drafter.config.block_size, drafter.config.loss_decay, 20
    anchors = sample_anchors(3, T, B, 50, torch.Generator().manual_seed(2))
    assert anchors.shape == (3, T - B) and all(sorted(r) == list(range(1, T - B + 1)) for r in anchors.tolist())
    anchors = sample_anchors(3, T, B, 5, torch.Generator().manual_seed(2))
    assert anchors.shape == (3, 5)
    assert all(len(set(r)) == 5 and 1 <= min(r) and max(r) <= T - B for r in anchors.tolist())
    windows = torch.randint(0, 50257, (3, T), generator=torch.Generator().manual_seed(3))
    drafter.config.anchors = 5
    try:
        loss, stats = dflash_loss(drafter, windows, torch.Generator().manual_seed(2))
    finally:
        drafter.config.anchors = 32
    weights = torch.tensor([2.718281828459045 ** (-(k - 1) / g) for k in range(1, B)], dtype=torch.float64)
    total, first = 0.0, 0.0
    for b, a in itertools.product(range(3), range(5)):
        a = int(anchors[b, a])
        _, hidden = target(windows[b:b + 1, :a], causal=True, hidden_layers=drafter.config.taps)
        logits = draft_block(drafter, drafter.new_cache(), int(windows[b, a]), hidden)  # (B-1, V)
        logits[:, MASK] = float("-inf")  # never a label: the loss leaves it out, as inference does
        ce = F.cross_entropy(logits, windows[b, a + 1:a + B], reduction="none")  # slot k -> token a + k
        total += float((weights * ce).sum() / weights.sum())
        first += float(logits[0].argmax() == windows[b, a + 1])
    assert abs(float(loss) - total / 15) <= EXACT * total / 15 and float(stats["ce"]) == float(loss)
    assert float(stats["acc"]) == first / 15


@pytest.mark.parametrize("temperature", [None, 0.8], ids=["labels", "soft labels"])
def test_the_loss_read_a_window_at_a_time_has_the_whole_batchs_value_stats_and_gradients(models64, monkeypatch,
                                                                                         temperature):
    """dflash_loss holds a few windows' logits at a time and makes each chunk's again in the backward (activation
    checkpointing): in chunks of one window, its loss and gradients are those of the whole batch's logits at once
    (packed_logits and block_loss, no checkpoint), to float64 rounding; its stats the same means."""
    target, drafter = models64
    windows = torch.randint(0, 50257, (3, 20), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(dflash, "LOSS_ROWS", 1)
    loss, stats = dflash_loss(drafter, windows, torch.Generator().manual_seed(2), temperature)
    loss.backward()
    grads = {name: w.grad for name, w in drafter.named_parameters()}
    drafter.zero_grad(set_to_none=True)
    anchors = sample_anchors(3, 20, drafter.config.block_size, drafter.config.anchors, torch.Generator().manual_seed(2))
    whole, whole_stats = block_loss(drafter, windows, anchors, *packed_logits(drafter, windows, anchors), temperature)
    whole.backward()
    assert_same(loss, whole)
    for name, weight in drafter.named_parameters():
        assert_same(grads[name], weight.grad)
    drafter.zero_grad(set_to_none=True)
    assert all(abs(float(stats[k]) - float(whole_stats[k])) < 1e-6 for k in ("acc", "tau_proxy"))


@torch.no_grad()

def test_a_drafter_for_another_target_or_a_bad_config_is_a_clear_error(models):
    target, drafter = models
    for other in MISMATCHED_TARGETS:
        with pytest.raises(UserError, match="drafter was built for a target"):
            DFlashDrafter(drafter.config, random_model(other, seed=0))
    with pytest.raises(UserError, match="n_features"):
        DFlashConfig.for_target(target.config, n_features=3)
    with pytest.raises(UserError, match="too short"):
        dflash_loss(drafter, torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(UserError, match="not a DFlash drafter config"):
        drafter_from({"config": {"depth": 3}, "model": {}}, target)
