"""Spec: an EAGLE-3 head drafts from fused target features and its own, and trains on exactly what
it sees at inference (test_eagle_decode.py: it decodes losslessly as a chain or a tree).

Layer rule, frozen borrowing, checkpoint round trip; training step i gives draft step i+1's logits
(training-time test), by the mask shown; the 0.8^i-weighted distillation loss; tree scores are each
path read as a chain (ancestor-only draft mask), the verify mask the ancestor closure.
"""

import torch
from eagle_models import models, models64  # noqa: F401 (fixtures)
from stats_helpers import (
    EXACT,
    assert_same,
    one_thread,  # noqa: F401 (an autouse fixture: one torch thread)
)

from tinydiff import dflash
from tinydiff.eagle3 import draft_chain, draft_tree, eagle_layers, eagle_loss, log_probs, unroll_mask, unrolled_logits
from tinydiff.io.checkpoint import head_from, load_checkpoint, save_checkpoint
from tinydiff.sampling import next_token_probs, soft_ce
from tinydiff.tokenizer import EOT, MASK

GREEDY = (0, None, None)  # warp args


def prefilled(target, head, seq):
    """The head's cache and ready state after reading seq[:-1] with the target's features."""
    cache = head.new_cache()
    _, hidden = target(torch.tensor([seq[:-1]]), causal=True, hidden_layers=head.config.feature_layers)
    return cache, head.extend(cache, torch.tensor([seq[1:]]), hidden)


def test_layer_rule_config_and_frozen_borrowing(models, tmp_path):
    assert [eagle_layers(L) for L in (32, 8, 5, 4, 2)] == [[2, 16, 29], [2, 4, 5], [1, 3, 5], [1, 2, 4], [1, 1, 2]]
    target, head = models
    assert head.config.feature_layers == [1, 3, 5] and (head.fuse.in_features, head.proj.in_features) == (96, 64)
    assert not any(k.startswith(("target", "embed.")) for k in head.state_dict())
    assert not {id(p) for p in head.parameters()} & {id(p) for p in target.parameters()}
    windows = torch.randint(0, 50257, (2, 12), generator=torch.Generator().manual_seed(0))
    loss, stats = eagle_loss(head, windows)
    loss.backward()
    assert all(p.grad is None for p in target.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())
    head.zero_grad(set_to_none=True)
    assert set(stats) == {"ce", "acc", "acc_last", "tau_proxy"} and float(stats["tau_proxy"]) >= 1
    # Checkpoint round trip: kind eagle3, weights only; rebuilt, it drafts the same.
    save_checkpoint(tmp_path / "ckpt.pt", kind="eagle3", config=head.config, model=head, step=3)
    rebuilt = head_from(load_checkpoint(tmp_path / "ckpt.pt"), target, tmp_path / "ckpt.pt")
    drafted = []
    with torch.no_grad():
        for h in (head, rebuilt):
            cache, ready = prefilled(target, h, [EOT, 5, 6, 7])
            drafted.append(draft_chain(h, cache, ready, 3, GREEDY)[2])
    assert torch.equal(*drafted)


@torch.no_grad()
def test_training_unroll_sees_exactly_what_inference_drafting_sees(models64):
    """For a committed prefix, draft_chain's logits at draft step i+1 (fed its own hidden states)
    equal the training unroll's step-i logits at the row that drafts after that prefix, on a
    window holding the prefix and the same drafts (what training reads where inference drafted), to
    float64 rounding: both run in float64, so no CPU's summation order can move them apart by more.
    The mask, 5 rows at step 2: row r drafts after committed row c = r - 2 and sees step 0's rows
    0..c, then row c+1 of step 1 and c+2 = r of step 2; rows 0, 1 have no committed row."""
    rows = ["..... ..... #....", "..... ..... .#...", "#.... .#... ..#..", "##... ..#.. ...#.", "###.. ...#. ....#"]
    assert [" ".join("".join("#" if m else "." for m in row[i:i + 5]) for i in (0, 5, 10))
            for row in unroll_mask(5, 2).tolist()] == rows
    assert torch.equal(unroll_mask(4, 0), torch.ones(4, 4, dtype=torch.bool).tril())  # step 0: causal
    target, head = models64
    K, g = 4, torch.Generator().manual_seed(7)
    for length in (2, 3, 7):
        prompt = torch.randint(0, 50257, (length,), generator=g).tolist()
        cache, ready = prefilled(target, head, prompt)
        drafts, _, logits = draft_chain(head, cache, ready, K, GREEDY)  # (K,), _, (K, V)
        assert cache.length == length - 1  # draft rows never enter the cache
        window = torch.tensor([prompt + drafts.tolist(), prompt + drafts.tolist()[::-1]])  # row 1: other drafts
        unrolled, _ = unrolled_logits(head, window, K)
        c = length - 2  # the newest committed row
        for i in range(K):
            assert_same(unrolled[i][0, c + i], logits[i])
        assert_same(unrolled[0][1, c], unrolled[0][0, c])  # step 0 reads no draft


def test_loss_is_the_weighted_distillation_cross_entropy(models64):
    """sum_i 0.8^i CE_i / sum_i 0.8^i, CE_i averaged over rows r >= i of step i, each against the
    target's own distribution for token r+2 (MASK left out); steps=1 is step 0's CE alone. In float64:
    to float64 rounding."""
    target, head = models64
    windows = torch.randint(0, 50257, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        unrolled, target_logits = unrolled_logits(head, windows, 3)
        loss, stats = eagle_loss(head, windows, steps=3)
        one, _ = eagle_loss(head, windows, steps=1)
    ces = []
    for i in range(3):
        rows = [(b, r) for b in range(2) for r in range(i, 9)]
        ces.append(sum(float(-(torch.softmax(target_logits[b, r + 1, :MASK], -1) *
                               torch.log_softmax(unrolled[i][b, r, :MASK], -1)).sum()) for b, r in rows) / len(rows))
    expected = sum(0.8 ** i * ce for i, ce in enumerate(ces)) / sum(0.8 ** i for i in range(3))
    assert abs(float(loss) - expected) <= EXACT * expected and abs(float(one) - ces[0]) <= EXACT * ces[0]
    assert float(stats["ce"]) == float(loss)
    want = target_logits[:, 1:, :MASK].argmax(-1)
    assert float(stats["acc"]) == float((unrolled[0][..., :MASK].argmax(-1) == want).float().mean())


def test_the_loss_read_a_chunk_of_rows_at_a_time_has_the_whole_batchs_value_stats_and_gradients(models64, monkeypatch):
    """eagle_loss holds LOSS_ROWS rows' logits at a time and makes each chunk's again in the backward (activation
    checkpointing): its loss and gradients are those of the whole batch's logits at once (unrolled_logits and the
    weighted CE), to float64 rounding, and its stats those of one chunk. 5 windows of 9 rows in chunks of 2 windows
    (2 x 3 steps x 9 rows): the last chunk is short."""
    target, head = models64
    windows = torch.randint(0, 50257, (5, 10), generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(dflash, "LOSS_ROWS", 2 * 3 * 9)
    loss, stats = eagle_loss(head, windows, steps=3)
    loss.backward()
    grads = {name: w.grad for name, w in head.named_parameters()}
    head.zero_grad(set_to_none=True)
    logits, target_logits = unrolled_logits(head, windows, 3)
    p, w = next_token_probs(target_logits[:, 1:], 1.0), [0.8 ** i for i in range(3)]
    whole = sum(wi * soft_ce(lg[:, i:], p[:, i:]).mean() for i, (wi, lg) in enumerate(zip(w, logits))) / sum(w)
    whole.backward()
    assert_same(loss, whole)
    for name, weight in head.named_parameters():
        assert_same(grads[name], weight.grad)
    head.zero_grad(set_to_none=True)
    monkeypatch.setattr(dflash, "LOSS_ROWS", 10 ** 9)
    with torch.no_grad():
        one = eagle_loss(head, windows, steps=3)[1]
    assert all(torch.equal(one[k], stats[k]) for k in ("acc", "acc_last", "tau_proxy"))


@torch.no_grad()
def test_tree_scores_are_each_path_read_as_a_chain_and_its_mask_is_the_ancestor_closure(models64):
    """Each node's score is the head's log-probs summed along its path read one token at a time (no
    siblings anywhere): the draft mask shows ancestors only (in float64: to float64 rounding). Best-first,
    parents first, siblings distinct, <= budget nodes, branch children, depth levels; the verify
    visibility is the parent closure."""
    target, head = models64
    shapes = {"deep": 0, "branching": 0}
    for seq, depth, branch, budget in (([EOT, 4], 4, 2, 10), ([EOT, 5, 6, 7], 3, 3, 12), ([9, 8], 5, 4, 40)):
        cache, ready = prefilled(target, head, seq)
        tree, forwards = draft_tree(head, cache, ready, depth, branch, budget)
        n = cache.length
        assert forwards == depth - 1 and tree.size == budget and int(tree.depths.max()) <= depth
        shapes["deep"] += int(tree.depths.max()) >= 3
        assert all(tree.scores[i] <= tree.scores[i - 1] for i in range(2, tree.size + 1))  # best-first
        closure = torch.eye(tree.size + 1, dtype=torch.bool)
        for i in range(1, tree.size + 1):
            parent = int(tree.parents[i])
            assert 0 <= parent < i and tree.depths[i] == tree.depths[parent] + 1
            closure[i] |= closure[parent]
            siblings = [int(tree.tokens[j]) for j in range(1, tree.size + 1) if tree.parents[j] == parent]
            assert len(siblings) == len(set(siblings)) <= branch
            shapes["branching"] += len(siblings) > 1 and parent > 0
        assert torch.equal(tree.visibility, closure)
        assert len({int(tree.parents[i]) for i in range(1, tree.size + 1) if tree.depths[i] == 3}) <= branch
        for i in range(1, tree.size + 1):
            logits, hidden = ready
            past_k, past_v = cache.k[0][:, :, :n], cache.v[0][:, :, :n]
            score = 0.0
            for j, node in enumerate(tree.path(i), 1):
                token = int(tree.tokens[node])
                score += float(log_probs(logits)[token])
                if node != i:
                    lg, h, k, v = head(torch.tensor([[token]]), hidden.view(1, 1, -1), torch.tensor([n + j]),
                                       past_k, past_v)
                    past_k, past_v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
                    logits, hidden = lg[0, 0], h[0, 0]
            assert abs(score - float(tree.scores[i])) <= EXACT * (1 + abs(score)), (seq, i)
    assert min(shapes.values()) > 0, shapes
