"""Spec: fused_round.py's graph of a speculative round with its verdict decides exactly what the eager
loop decides (the AR step's graph is tests/test_fused_steps.py's). `verdict` is speculative.verify
given the numbers verify draws: the same accepted count and token for every p, q and draft, greedy
included; `sampled_verdict`, its fast path at a plain temperature, decides as it does. The fused
loop, run here uncompiled (compile=False: the same functions, eagerly; tests/test_compiled.py runs it
compiled), commits the eager loop's tokens from the same seeds at every warp, with the same counts
and the same cache rows after every round, stops where it stops, and refuses what it refuses. Being
the eager loop's tokens draw for draw, its samples follow the target's distribution as those do
(test_speculative.py's chi-square tests). The models are float64: two paths differ by float64
rounding only, far below any sampling boundary."""
import pytest
import torch
from stats_helpers import assert_caches_equal, assert_same, float64, one_thread, perturbed, random_model  # noqa: F401 (one_thread: autouse)

from tinydiff.checks import UserError
from tinydiff.fast.compiled import compiled
from tinydiff.fast.frequent_vocab import FrequentVocabDraft, every_id, in_vocab, subset_draft_round
from tinydiff.fast.fused_round import (
    PREFILL_CHUNK,
    FusedSpeculation,
    fused_speculative_generate,
    prefill,
    sampled_verdict,
    verdict,
)
from tinydiff.model import ModelConfig
from tinydiff.sampling import next_token_probs
from tinydiff.speculative import speculative_generate, verify
from tinydiff.tokenizer import MASK

PROMPT, NEW, K = [3, 1, 4, 1, 5], 24, 3
WARPS = [(0.0, None, None), (1.0, None, None), (0.8, 5, None), (1.3, None, 0.9)]


@pytest.fixture(scope="module")
def models():
    target = random_model(ModelConfig(vocab_size=64, context=40, n_layer=2, n_head=2, d_model=32, d_ff=64), seed=0)
    (target,) = float64(target)
    # Close to the target, so that rounds accept every draft too; ids that are multiples of 9 only come
    # back through the residual.
    draft = FrequentVocabDraft(perturbed(target, seed=5, noise=0.01), [i for i in range(64) if i % 9])
    spec = FusedSpeculation(compiled(target, (), compile=False), target, draft, K, compile=False)
    return target, draft, spec


def test_verdict_is_verifys_rule_with_the_numbers_verify_draws():
    g = torch.Generator().manual_seed(0)
    V, outcomes = 12, set()
    for trial in range(400):
        sharp = 0.3 + 3 * torch.rand((), generator=g)  # from near-uniform rows to near-one-hot ones
        p = torch.softmax(sharp * torch.randn(K + 1, V, generator=g, dtype=torch.float64), -1)
        q = torch.softmax(sharp * torch.randn(K, V, generator=g, dtype=torch.float64), -1)
        if trial % 4 == 0:  # a draft near the target: full acceptances
            q = 0.9 * p[:K] + 0.1 * q
        drafts = torch.multinomial(q, 1, generator=g)[:, 0]
        state = g.get_state()
        n, token = verify(p, q, drafts, g)
        g.set_state(state)  # the same numbers, drawn as the fused round draws them
        u_accept = torch.rand(K, generator=g)
        u_last = torch.rand(1, 1, generator=g, dtype=torch.float64)
        ours = verdict(p, q, drafts, u_accept, u_last, greedy=False)
        assert (int(ours[0]), int(ours[1])) == (n, token)
        outcomes.add(n)
    assert outcomes == set(range(K + 1))  # every accepted count was met, full acceptances included
    for trial in range(50):  # greedy: one-hot rows, no number for the last draw
        p = torch.nn.functional.one_hot(torch.randint(0, V, (K + 1,), generator=g), V).double()
        drafts = torch.where(torch.rand(K, generator=g) < 0.7, p[:K].argmax(-1), torch.randint(0, V, (K,), generator=g))
        q = torch.nn.functional.one_hot(drafts, V).double()
        n, token = verify(p, q, drafts, torch.Generator().manual_seed(trial))
        ours = verdict(p, q, drafts, torch.rand(K, generator=torch.Generator().manual_seed(trial)), None, greedy=True)
        assert (int(ours[0]), int(ours[1])) == (n, token)


def test_a_verdict_on_the_first_m_slots_is_verify_on_m_drafts():
    """A story's last rounds verify fewer drafts than the graph makes: with live = the first m slots, verdict
    decides as verify on those m drafts and the m + 1 rows that read them, given verify's numbers (the
    slots past m get zeros), the bonus included; and so does sampled_verdict."""
    g = torch.Generator().manual_seed(2)
    V, outcomes = 12, set()
    for trial in range(400):
        m = trial % K  # 0 .. K - 1 verified drafts
        temperature = (1.0, 0.7)[trial % 2]
        logits = (0.3 + 3 * torch.rand((), generator=g)) * torch.randn(K + 1, V, generator=g, dtype=torch.float64)
        p = next_token_probs(logits, temperature)  # (K + 1, V)
        small = torch.softmax(torch.randn(K, V, generator=g, dtype=torch.float64), -1)
        small = torch.where(torch.rand(K, 1, generator=g) < 0.5, 0.9 * p[:K] + 0.1 * small, small)  # full acceptances too
        drafts = torch.multinomial(small, 1, generator=g)[:, 0]
        state = g.get_state()
        n, token = verify(p[:m + 1], small[:m], drafts[:m], g)
        g.set_state(state)
        u_accept = torch.cat([torch.rand(m, generator=g), torch.zeros(K - m)])
        u_last = torch.rand(1, 1, generator=g, dtype=torch.float64)
        live = torch.arange(K) < m
        ours = verdict(p, small, drafts, u_accept, u_last, greedy=False, live=live)
        assert (int(ours[0]), int(ours[1])) == (n, token)
        ids = torch.arange(V)  # the whole vocabulary as the subset
        fast = sampled_verdict(logits, small, drafts, ids, drafts, u_accept, u_last, temperature, live)
        assert (int(fast[0]), int(fast[1])) == (n, token)
        outcomes.add((m, n))
    assert outcomes == {(m, n) for m in range(K) for n in range(m + 1)}  # every count, the bonus's included


def test_the_sampled_verdict_decides_as_verdict_does():
    """sampled_verdict (plain temperature, from logits and the draft's subset) against verdict on the warped
    probabilities, with the same numbers: the same count and token every time, in float64."""
    g = torch.Generator().manual_seed(1)
    V, N, outcomes, outside = 12, 8, set(), 0
    for trial in range(400):
        temperature = (1.0, 0.7, 1.3)[trial % 3]
        logits = (0.3 + 3 * torch.rand((), generator=g)) * torch.randn(K + 1, V, generator=g, dtype=torch.float64)
        ids = torch.randperm(V, generator=g)[:N]
        small = torch.softmax(torch.randn(K, N, generator=g, dtype=torch.float64), -1)  # (K, N)
        p = next_token_probs(logits, temperature)  # (K + 1, V)
        if trial % 4 == 0:  # a draft near the target: full acceptances
            small = 0.9 * p[:K, ids] / p[:K, ids].sum(-1, keepdim=True) + 0.1 * small
        picks = torch.multinomial(small, 1, generator=g)[:, 0]
        u_accept, u_last = torch.rand(K, generator=g), torch.rand(1, 1, generator=g, dtype=torch.float64)
        n, token = verdict(p, in_vocab(small, ids, V), ids[picks], u_accept, u_last, greedy=False)
        ours = sampled_verdict(logits, small, picks, ids, ids[picks], u_accept, u_last, temperature)
        assert (int(ours[0]), int(ours[1])) == (int(n), int(token))
        outcomes.add(int(n))
        outside += int(token) not in ids.tolist()
    assert outcomes == set(range(K + 1)) and outside > 0  # every count met; residual draws outside the subset
    # A language model's vocabulary holds MASK, which neither ever commits.
    logits = torch.zeros(K + 1, MASK + 1, dtype=torch.float64)
    logits[:, MASK] = 50.0
    ids = torch.tensor([MASK, 7])
    small = torch.tensor([[0.5, 0.5]] * K, dtype=torch.float64)
    picks = torch.zeros(K, dtype=torch.long)  # every draft is MASK: rejected at once
    u_accept, u_last = torch.rand(K, generator=g), torch.rand(1, 1, generator=g, dtype=torch.float64)
    p = next_token_probs(logits, 1.0)
    n, token = verdict(p, in_vocab(small, ids, MASK + 1), ids[picks], u_accept, u_last, greedy=False)
    ours = sampled_verdict(logits, small, picks, ids, ids[picks], u_accept, u_last, 1.0)
    assert int(ours[0]) == int(n) == 0 and int(ours[1]) == int(token) != MASK


@pytest.mark.parametrize("length", [1, 5, 8, 20, 36])
def test_a_chunked_prefill_reads_the_prompt_as_one_forward_does(length):
    # A context of 37: a 36-token prompt's last chunk has no room for its padding and is read as it is.
    config = ModelConfig(vocab_size=64, context=37, n_layer=2, n_head=2, d_model=32, d_ff=64)
    (target,) = float64(random_model(config, seed=1))
    prompt = torch.randint(0, 64, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    static = compiled(target, (), compile=False)
    cache, reference = static.new_cache(1), target.new_cache(1)
    logits, forwards = prefill(static, cache, prompt)
    expected = target(torch.tensor([prompt]), cache=reference, causal=True)[:, -1]
    assert forwards == -(-length // PREFILL_CHUNK) and cache.length == reference.length == length
    assert_same(logits, expected)
    assert_caches_equal((cache, reference))  # the padding lies past the length, unread


def recorded(decode, *args, **kwargs):
    """decode's tokens, result and per round (accepted, tokens, cache copies)."""
    rounds = []
    def on_round(info):
        caches = [(c.length, [t.clone() for t in c.k + c.v]) for c in (info["target_cache"], info["draft_cache"])]
        rounds.append((info["accepted"], info["tokens"], caches))
    out, result = decode(*args, on_round=on_round, **kwargs)
    return out, result, rounds


@pytest.mark.parametrize("vocab_size", [64, MASK + 1])  # MASK + 1: GPT-2's vocabulary and MASK, its last id
def test_a_plain_draft_as_the_subset_of_every_id_commits_speculative_generates_tokens(vocab_size):
    """The bench's and generate.py's compiled spec rounds: the plain draft as FR-Spec's draft of every id
    but MASK (frequent_vocab.every_id) draws draft_round's tokens from the same numbers."""
    config = ModelConfig(vocab_size=vocab_size, context=40, n_layer=2, n_head=2, d_model=32, d_ff=64)
    (target,) = float64(random_model(config, seed=0))
    draft = perturbed(target, seed=5, noise=0.05)  # close to the target: rounds accept several drafts
    subset = every_id(draft)
    assert len(subset.ids) == vocab_size - (vocab_size > MASK) and not bool((subset.ids == MASK).any())
    spec = FusedSpeculation(compiled(target, (), compile=False), target, subset, K, compile=False)
    accepted = 0
    for warp in WARPS:
        for seed in range(2):
            g = lambda: torch.Generator().manual_seed(seed)  # noqa: E731
            ours, ours_result = fused_speculative_generate(spec, PROMPT, NEW, *warp, generator=g(), stop_token=None)
            theirs, result = speculative_generate(target, draft, PROMPT, NEW, K, *warp, generator=g(), stop_token=None)
            assert ours == theirs and ours_result.accepted == result.accepted
            assert ours_result.forwards == result.forwards + 1  # the prompt read apart
            accepted += sum(n * count for n, count in enumerate(result.accepted))
    assert accepted > 0


@pytest.mark.parametrize("warp", WARPS)
def test_the_fused_round_commits_speculative_generates_tokens_counts_and_caches(models, warp):
    target, draft, spec = models
    full = set()
    for seed in range(3):
        ours, ours_result, ours_rounds = recorded(fused_speculative_generate, spec, PROMPT, NEW, *warp,
                                                  generator=torch.Generator().manual_seed(seed), stop_token=None)
        theirs, result, rounds = recorded(speculative_generate, target, draft, PROMPT, NEW, K, *warp,
                                          generator=torch.Generator().manual_seed(seed), stop_token=None,
                                          propose=subset_draft_round)
        assert ours == theirs and len(ours) == NEW
        assert ours_result.accepted == result.accepted and ours_result.slot_kept == result.slot_kept
        # The fused loop reads the prompt in a forward of its own; the eager loop's first verify reads it.
        assert ours_result.forwards == result.forwards + 1 and ours_result.draft_forwards == result.draft_forwards
        assert ours_result.draft_seconds is None  # a fused round has no stages to clock
        assert 0 < ours_result.graph_seconds < ours_result.seconds  # its graphs' calls, inside the timed loop
        for (n, tokens, caches), (m, reference_tokens, reference) in zip(ours_rounds, rounds, strict=True):
            assert (n, tokens) == (m, reference_tokens)
            for (length, rows), (reference_length, reference_rows) in zip(caches, reference):
                assert length == reference_length
                for a, b in zip(rows, reference_rows):
                    torch.testing.assert_close(a[:, :, :length], b[:, :, :length], rtol=0, atol=1e-12)
        full |= {n for n, _, _ in ours_rounds[1:]}
    assert K in full  # a full acceptance happened, so a fused round read two catch-up tokens


def test_the_fused_loop_stops_where_the_eager_loop_stops(models):
    target, draft, spec = models
    g = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    story = fused_speculative_generate(spec, PROMPT, NEW, 1.0, generator=g(), stop_token=None)[0]
    stop = story[NEW // 2]  # a round may commit tokens past it: they are dropped
    ours = fused_speculative_generate(spec, PROMPT, NEW, 1.0, generator=g(), stop_token=stop)[0]
    theirs = speculative_generate(target, draft, PROMPT, NEW, K, 1.0, generator=g(), stop_token=stop,
                                  propose=subset_draft_round)[0]
    assert ours == theirs == story[:story.index(stop) + 1]


def test_the_fused_loop_commits_the_eager_tokens_after_a_one_token_prompt_and_up_to_the_context(models,
                                                                                                  monkeypatch):
    """The loop's other paths: a 1-token prompt (no prefill; the first round's draft reads one token,
    its own shape), and a story that fills the context, where the last rounds have no room for the
    graph's k + 1 rows and run the eager pieces."""
    target, draft, spec = models
    graph_rounds = []
    run_round = spec.run_round
    monkeypatch.setattr(spec, "run_round", lambda *a: graph_rounds.append(1) or run_round(*a))
    eager_rounds = 0
    for prompt, new in (([7], NEW), (PROMPT, target.config.context - len(PROMPT))):
        for seed in range(3):
            g = lambda: torch.Generator().manual_seed(seed)  # noqa: E731
            graph_rounds.clear()
            ours, ours_result = fused_speculative_generate(spec, prompt, new, 1.0, generator=g(), stop_token=None)
            theirs, result = speculative_generate(target, draft, prompt, new, K, 1.0, generator=g(), stop_token=None,
                                                  propose=subset_draft_round)
            assert ours == theirs and len(ours) == new and ours_result.accepted == result.accepted
            eager_rounds += ours_result.rounds - len(graph_rounds)
    assert eager_rounds > 0  # the context's end was reached inside a round


def test_bad_input_is_a_one_line_error(models):
    target, draft, spec = models
    with pytest.raises(UserError, match="prompt is empty"):
        fused_speculative_generate(spec, [], 4)
    with pytest.raises(UserError, match="temperature"):
        fused_speculative_generate(spec, PROMPT, 4, temperature=-1.0)
    with pytest.raises(UserError, match="max new tokens"):
        fused_speculative_generate(spec, PROMPT, 1000)
    with pytest.raises(UserError, match="pruned draft"):
        FusedSpeculation(compiled(target, (), compile=False), target, target, K, compile=False)
