"""Spec: an EAGLE-3 head drafts from fused target features and its own, trains on exactly what it
sees at inference, and decodes losslessly as a chain or a tree.

Layer rule, frozen borrowing, checkpoint round trip; training step i gives draft step i+1's logits
(training-time test), by the mask shown; the 0.8^i-weighted distillation loss; tree scores are each
path read as a chain (ancestor-only draft mask), the verify mask the ancestor closure; greedy output
is the target's; an oracle head reaches tau == k+1; caches equal a recomputation after every round;
MASK never comes out; sampled output follows the exact joint (chi-square); bad input is a clear error.
"""
import itertools
from dataclasses import asdict

import pytest
import torch
from stats_helpers import (DFLASH_DIST_CONFIG, EXACT, NEW, PROMPT, assert_caches_equal, assert_follows_the_joint,
                           assert_same, check_block_counts, exact_joint, float64, random_model, recorded_run,
                           sample_counts)
from stats_helpers import one_thread  # noqa: F401 (an autouse fixture: one torch thread)
from table_models import TableTarget, TreeTableTarget

from tinydiff.ar import ar_generate
from tinydiff.checkpoint import load_checkpoint, save_checkpoint
from tinydiff.eagle import EagleConfig, EagleHead, eagle_layers, eagle_loss, head_from, unroll_mask, unrolled_logits
from tinydiff.eagle_decode import draft_chain, draft_tree, eagle_generate, log_probs
from tinydiff.errors import UserError
from tinydiff.model import ModelConfig
from tinydiff.sampling import next_token_probs
from tinydiff.tokenizer import EOT, MASK

GREEDY = (0, None, None)  # warp args


def random_head(target, seed, std=0.5, kind=None, **overrides):
    """An untrained head (EagleHead or `kind`) whose weights matter (the default init barely does), in
    the target's dtype (a float64 target's head holds the float32 one's weights, widened)."""
    torch.manual_seed(seed)
    head = (kind or EagleHead)(EagleConfig.for_target(target.config, **overrides), target).eval()
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return head.to(target.embed.weight.dtype)


def prefilled(target, head, seq):
    """The head's cache and ready state after reading seq[:-1] with the target's features."""
    cache = head.new_cache()
    _, hidden = target(torch.tensor([seq[:-1]]), causal=True, hidden_layers=head.config.feature_layers)
    return cache, head.extend(cache, torch.tensor([seq[1:]]), hidden)


class MemoHead(EagleHead):
    """An EagleHead that returns stored outputs for inputs it has seen: no answer changes (the head is
    deterministic), but a chi-square test's thousands of generations skip recomputing rows."""

    def forward(self, *args):
        key = tuple(a if a is None else (a.shape, a.numpy().tobytes()) for a in args)
        if key not in self.__dict__.setdefault("memo", {}):
            self.memo[key] = super().forward(*args)
        return self.memo[key]


class HeadOracle:
    """Makes a head draft from the target: each row's logits become the target's after the tokens the row
    stands for (those of the latest earlier row its mask shows: previous row, draft or tree parent, plus
    its own), plus SHARP on the target's pick. Where wrong(position predicted), a decoy gets the pick's
    logit + 1: a chain drafts it, a tree of branch >= 2 still holds the pick. reset(prompt) before a run."""
    SHARP = 20.0

    def __init__(self, head, target, wrong=lambda position: False):
        self.head, self.target, self.wrong, self.memo = head, target, wrong, {}
        head.register_forward_hook(self.hook)

    def reset(self, prompt):
        self.first, self.rows = list(prompt[:1]), []

    def hook(self, module, args, output):
        tokens, past, mask = args[0], args[3].shape[2], args[5] if len(args) > 5 else None  # as eagle passes them
        del self.rows[past:]  # draft rows of earlier forwards this round that this one does not read
        logits = output[0].clone()
        for i, token in enumerate(tokens[0].tolist()):
            visible = torch.arange(past + i) if mask is None else mask[i, :past + i].nonzero()
            seen = int(visible.max()) if len(visible) else -1
            self.rows.append((self.first if seen < 0 else self.rows[seen]) + [token])
            key = tuple(self.rows[-1])
            if key not in self.memo:
                self.memo[key] = self.target(torch.tensor([key]), causal=True, head_from=len(key) - 1)[0, -1]
            row = self.memo[key].clone()
            pick = int(next_token_probs(row, 0).argmax())
            row[pick] += self.SHARP
            if self.wrong(len(key)):
                row[(pick + 1) % min(len(row), MASK)] = row[pick] + 1
            logits[0, i] = row
        return (logits, *output[1:])


@pytest.fixture(scope="module")
def models():  # GPT-2's full vocabulary (and MASK); five target layers: features after blocks [1, 3, 5]
    target = random_model(ModelConfig(context=40, n_layer=5, n_head=2, d_model=32, d_ff=64), seed=0)
    return target, random_head(target, seed=1)


@pytest.fixture(scope="module")
def models64(models):  # the same in float64: tests that compare two code paths hold them to float64 rounding
    return float64(*models)


@pytest.fixture(scope="module")
def small_vocab():  # 16 ids: a random head's drafts and trees hit the target's picks now and then; float64
    target = random_model(ModelConfig(vocab_size=16, context=40, n_layer=4, n_head=2, d_model=32, d_ff=64), seed=0)
    return float64(target, random_head(target, seed=1))


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


def run(target, head, prompt, n, oracle=None, on_round=None, **kwargs):
    """eagle_generate with every round's info recorded (caches left out); the oracle reset first."""
    if oracle is not None:
        oracle.reset(prompt)
    return recorded_run(eagle_generate, target, head, prompt, n, None, on_round, **kwargs)


def check_counts(out, stats, rounds, n, k, budget, prompt_length):
    """The stats agree with the rounds; each round drafts min(k, what remains - 1) deep (nothing in a
    one-token prompt's first round); the head's forwards add up."""
    check_block_counts(out, stats, rounds, k + 1, prompt_length)
    done, forwards = 0, stats["rounds"] + (prompt_length > 1)  # committed-row reads: each round, the prompt
    for r in rounds:
        depth = 0 if done == 0 and prompt_length == 1 else min(k, n - done - 1)
        forwards += max(0, depth - 1)
        done += len(r["tokens"])
        if budget is None:
            assert len(r["drafts"]) == depth
        else:
            tree, path = r["tree"], r["path"]
            assert tree.size <= budget and int(tree.depths.max()) <= depth and r["accepted"] == len(path)
            assert [int(tree.parents[i]) for i in path] == [0, *path][:len(path)]
    assert stats["draft_forwards"] == forwards
    assert stats["proposed"] == sum(len(r["drafts"]) if budget is None else r["tree"].size for r in rounds)
    assert budget is None or stats["nodes_per_round"] == stats["proposed"] / stats["rounds"]


def branch_steps(rounds):
    """Accepted tree nodes that are not their parent's first (best) child: only a tree accepts them."""
    return sum(i != int((r["tree"].parents == r["tree"].parents[i]).nonzero()[0]) for r in rounds for i in r["path"])


SHAPES = ((1, None, 1), (3, None, 1), (5, None, 1), (3, 1, 2), (3, 4, 2), (4, 12, 3))  # k, budget, branch


@torch.no_grad()
def test_greedy_output_equals_the_targets_greedy_decoding(models64, small_vocab):
    """Token for token: chains of k = 1, 3, 5, trees of 1, 4, 12 nodes; 1- and 4-token prompts; with and
    without a stop token emitted mid-way; the decoy oracle (GPT-2's vocabulary), a random head (16 ids)."""
    target, _ = models64
    oracle = HeadOracle(random_head(target, seed=2), target, wrong=lambda position: position % 3 == 0)
    pairs = {"oracle": (target, oracle.head, oracle), "random, 16 ids": (*small_vocab, None)}
    seen = {"rejected": 0, "partial": 0, "full": 0, "branch": 0, "dropped_after_stop": 0}
    greedy = {}  # (seed, name, stop): the stop token and the target's greedy output, the same for every shape
    for seed, (k, budget, branch), name, stop in itertools.product(range(2), SHAPES, pairs, ("none", "mid")):
        model, head, orc = pairs[name]
        prompt = [1 + seed] + torch.randint(0, model.config.vocab_size - 1, (3 * seed,),
                                             generator=torch.Generator().manual_seed(seed)).tolist()
        if (seed, name, stop) not in greedy:
            full, _ = ar_generate(model, prompt, 24, temperature=0, stop_token=None)
            stop_token = None if stop == "none" else full[13]
            expected, _ = ar_generate(model, prompt, 24, temperature=0, stop_token=stop_token)
            greedy[seed, name, stop] = stop_token, expected
        stop_token, expected = greedy[seed, name, stop]
        out, stats, rounds = run(model, head, prompt, 24, orc, k=k, budget=budget, branch=branch, temperature=0,
                                 stop_token=stop_token)
        assert out == expected, (seed, k, budget, name, stop)
        check_counts(out, stats, rounds, 24, k, budget, len(prompt))
        depth = [len(r["drafts"]) if budget is None else int(r["tree"].depths.max()) for r in rounds]
        seen["rejected"] += stats["accepted"][0]
        seen["partial"] += sum(0 < r["accepted"] < d for r, d in zip(rounds, depth))
        seen["full"] += sum(0 < r["accepted"] == d for r, d in zip(rounds, depth))
        seen["branch"] += branch_steps(rounds) if budget else 0
        seen["dropped_after_stop"] += len(rounds[-1]["tokens"]) < rounds[-1]["accepted"] + 1
    assert min(seen.values()) > 0, seen  # every kind of round, or the test proves nothing


@torch.no_grad()
def test_a_head_that_knows_the_target_gives_tau_k_plus_1(models64):
    """Without decoys a chain accepts all k drafts every round. With a decoy ahead of the target's pick at
    every even position a chain stops at one each round; a tree keeping both branches accepts all k."""
    target, _ = models64
    never, even = (lambda position: False), (lambda position: position % 2 == 0)
    for k, prompt in itertools.product((2, 4), ([EOT], [EOT, 7, 8, 9])):
        n = 3 * (k + 1) + (len(prompt) == 1)  # a one-token prompt's first round has nothing to draft from
        expected = ar_generate(target, prompt, n, temperature=0, stop_token=None)[0]
        full = [int(len(prompt) == 1)] + [0] * (k - 1) + [3]
        for name, wrong, budget in (("chain", never, None), ("tree, decoys", even, 16), ("chain, decoys", even, None)):
            oracle = HeadOracle(random_head(target, seed=3), target, wrong)
            out, stats, rounds = run(target, oracle.head, prompt, n, oracle, k=k, budget=budget, branch=4,
                                     temperature=0, stop_token=None)
            assert out == expected
            check_counts(out, stats, rounds, n, k, budget, len(prompt))
            assert (stats["accepted"] == full) == (name != "chain, decoys"), (name, k, prompt, stats["accepted"])
            if budget is not None:
                assert branch_steps(rounds) > 0


@torch.no_grad()
def test_caches_hold_exactly_the_committed_context_after_every_round(models64, small_vocab):
    """After every round the target's cache and the head's cache hold rows for seq[:-1] and equal
    a recomputation from scratch (the head's: the target features of seq[:-1] with tokens seq[1:]),
    to float64 rounding."""
    checked = {"full": 0, "partial": 0, "stopped": 0}

    def check(info):  # model and head: the run's, from the loop below
        seq, tc, hc = info["seq"], info["target_cache"], info["draft_cache"]
        assert tc.length == hc.length == len(seq) - 1
        fresh_t, fresh_h = model.new_cache(), head.new_cache()
        _, hidden = model(torch.tensor([seq[:-1]]), cache=fresh_t, causal=True,
                          hidden_layers=head.config.feature_layers)
        head.extend(fresh_h, torch.tensor([seq[1:]]), hidden)
        assert_caches_equal((tc, fresh_t), (hc, fresh_h))
        depth = len(info["drafts"]) if "drafts" in info else int(info["tree"].depths.max())
        checked["full" if depth and info["accepted"] == depth else "partial"] += 1

    target, _ = models64
    oracle = HeadOracle(random_head(target, seed=3), target, wrong=lambda position: position % 4 == 0)
    big = (target, oracle.head, oracle)
    cases = [(*big, 0, None, [EOT, 3, 4, 5]), (*big, 0, 6, [EOT]), (*small_vocab, None, 1.0, None, [EOT % 16, 3]),
             (*small_vocab, None, 1.0, 8, [2])]
    for model, head, orc, temperature, budget, prompt in cases:
        shape = dict(k=3, budget=budget, temperature=temperature)
        stop = run(model, head, prompt, 20, orc, **shape, generator=torch.Generator().manual_seed(0),
                   stop_token=None)[0][9]
        out, _, _ = run(model, head, prompt, 20, orc, **shape, generator=torch.Generator().manual_seed(0),
                        stop_token=stop, on_round=check)
        checked["stopped"] += out[-1] == stop and len(out) < 20
    assert min(checked.values()) > 0, checked


@torch.no_grad()
def test_mask_never_comes_out(models):
    mask_target = random_model(models[0].config, seed=0)
    mask_head = random_head(mask_target, seed=1)
    bias = torch.zeros(mask_target.config.vocab_size).index_fill_(0, torch.tensor([MASK]), 100.0)  # MASK wins
    for model in (mask_target, mask_head):  # both return (logits, ...) here
        model.register_forward_hook(lambda module, args, output: (output[0] + bias, *output[1:]))
    for temperature, budget in itertools.product((0, 1.0), (None, 8)):
        out, _, rounds = run(mask_target, mask_head, [EOT, 3], 12, k=3, budget=budget, temperature=temperature,
                             stop_token=None, generator=torch.Generator().manual_seed(0))
        assert len(out) == 12 and MASK not in out
        assert all(MASK not in (r["drafts"] if budget is None else r["tree"].tokens.tolist()) for r in rounds)


def test_bad_input_is_a_clear_error(models):
    target, head = models
    other = random_model(ModelConfig(context=40, n_layer=4, n_head=2, d_model=32, d_ff=64), seed=0)
    zeros = torch.zeros(2, 3, dtype=torch.long)
    cases = [(lambda: eagle_generate(target, head, [1, 2], 5, k=k), "k ") for k in (0, 2.5, True)] + [
        (lambda: eagle_generate(target, head, [1, 2], 5, budget=0), "budget"),
        (lambda: eagle_generate(target, head, [1, 2], 5, budget=2.5), "budget"),
        (lambda: eagle_generate(target, head, [1, 2], 5, budget=4, branch=0), "branch"),
        (lambda: eagle_generate(target, target, [1, 2], 5), "EagleHead"),
        (lambda: eagle_generate(other, head, [1, 2], 5), "built for a target"),
        (lambda: eagle_generate(target, head, [], 5), "empty"),
        (lambda: eagle_generate(target, head, [1, 2], 5, temperature=-1), "temperature"),
        (lambda: eagle_generate(target, head, [1, 2], 39), "max new tokens"),
        (lambda: eagle_loss(head, zeros, steps=3), "too short"),
        (lambda: eagle_loss(head, zeros, steps=0), "steps"),
        (lambda: EagleConfig.for_target(target.config, feature_layers=[1, 2]), "feature_layers"),
        (lambda: EagleConfig.for_target(target.config, steps_ahead=0), "steps_ahead"),
        (lambda: head_from({"kind": "dflash", "config": {}, "model": {}}, target), "not an EAGLE-3 head"),
        (lambda: head_from({"config": {"depth": 3}, "model": {}}, target), "not an EAGLE-3 head config")]
    for call, message in cases:
        with pytest.raises(UserError, match=message):
            call()
    assert asdict(EagleConfig.for_target(target.config))["feature_layers"] == [1, 3, 5]


# Distribution: test_dflash's design (V = 6, 3 new tokens after a 2-token prompt, chi-square at significance
# 1e-3, power asserted), the target read through TableTarget / TreeTableTarget (real caches: proven above).
DIST_CASES = {  # budget (None: chain), k, branch, temperature, top_k, top_p, samples
    "chain, k 2": (None, 2, 1, 0.7, None, 0.9, 7_000),
    "tree, budget 3, branch 3": (3, 2, 3, 0.7, None, 0.9, 7_000),
}


@pytest.mark.parametrize("case", DIST_CASES)
@torch.no_grad()
def test_sampled_tokens_follow_the_exact_target_distribution(case):
    """At temperature 0.7 and top-p 0.9 (drafts and target must be warped alike): 40 bins, the heaviest
    0.046, so 7,000 samples catch one continuation off by 2 points with probability 0.93. Each case
    must see rejections, full acceptances and (trees) branch acceptances, or it proves nothing."""
    budget, k, branch, temperature, top_k, top_p, n = DIST_CASES[case]
    model = random_model(DFLASH_DIST_CONFIG, seed=1, embed_std=0.1)
    head = random_head(model, seed=5, kind=MemoHead)
    head.register_forward_hook(lambda module, args, output: (output[0] * 4, *output[1:]))  # sharper drafts
    probs = exact_joint(model, temperature, top_k, top_p)  # (V^NEW,)
    target = (TableTarget if budget is None else TreeTableTarget)(model, head.config.feature_layers)
    rounds = []
    counts, hist = sample_counts(lambda generator: eagle_generate(
        target, head, PROMPT, NEW, k, budget, branch, temperature, top_k, top_p, generator, stop_token=None,
        on_round=rounds.append), n, None, seed=1234)
    assert hist[0] > 0 and hist[NEW - 1] > 0 and (budget is None or branch_steps(rounds) > 0), hist
    assert_follows_the_joint(probs, counts, n)
