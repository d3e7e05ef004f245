"""Table-lookup test doubles for the speculative-decoding tests: TableModel and TableTarget (a
tiny Transformer's conditionals, computed once and looked up by the tokens a cache has read) with
their caches, and the DFlash oracles (drafters that guess right, or wrong on purpose). Not a test
file: the tests import from it.
"""
import torch
from stats_helpers import NEW, PROMPT, V, prefix_seqs

from tinydiff.speculative import next_token_probs
from tinydiff.tokenizer import MASK


class TokenCache:
    """What `TableModel` remembers: the tokens it has read, with KVCache's `length` and `crop`."""

    def __init__(self):
        self.tokens, self.length = [], 0

    def crop(self, n):
        assert 0 <= n <= self.length
        del self.tokens[n:]
        self.length = n


class TreeTokenCache(TokenCache):
    def keep(self, rows):
        self.tokens = [self.tokens[r] for r in rows]
        self.length = len(self.tokens)


class TableModel(torch.nn.Module):
    """A Transformer's conditionals after PROMPT, computed once with full forwards and then looked
    up by the tokens the cache has read, so a generation costs ~0.2 ms instead of ~1 ms and a
    powerful test fits in seconds. It answers exactly as the Transformer would for whatever
    speculative_generate feeds it, so wrong inputs or a wrong crop still show up as a wrong
    distribution; the real KV cache is proven separately (greedy and cache tests)."""

    def __init__(self, model, v=V, new=NEW, prompt=PROMPT):
        super().__init__()
        self.config, self.embed = model.config, model.embed
        if hasattr(model, "ids"):  # FR-Spec's draft: logits over its subset, which subset_draft_round reads
            self.ids = model.ids
        _, seqs = prefix_seqs(v, new, prompt)
        with torch.no_grad():
            logits = model(seqs, causal=True)  # (M, T, V)
        self.table = {tuple(seq[:t + 1]): row[t] for seq, row in zip(seqs.tolist(), logits)
                      for t in range(seqs.shape[1])}

    def new_cache(self, batch_size=1):
        return TokenCache()

    def forward(self, x, cache, causal=True):
        start = cache.length
        cache.tokens += x[0].tolist()
        cache.length = len(cache.tokens)
        return torch.stack([self.table[tuple(cache.tokens[:t + 1])] for t in range(start, cache.length)])[None]


class TableTarget(torch.nn.Module):
    """TableModel for a target read with hidden_layers: the logits and hidden states of every
    prefix of PROMPT + (NEW - 1) tokens from full forwards, looked up by the tokens its cache has
    read, so a generation costs a fraction of a millisecond. It answers exactly as the Transformer
    would for whatever dflash_generate feeds it; its KV cache is proven by the cache test."""

    def __init__(self, model, layers):
        super().__init__()
        self.config, self.embed, self.layers = model.config, model.embed, layers
        _, seqs = prefix_seqs()
        logits, hidden = model(seqs, causal=True, hidden_layers=layers)  # (M, T, V), N x (M, T, D)
        self.table = {tuple(seq[:t + 1]): (logits[m, t], [h[m, t] for h in hidden])
                      for m, seq in enumerate(seqs.tolist()) for t in range(seqs.shape[1])}

    def new_cache(self, batch_size=1):
        return TokenCache()

    def forward(self, x, cache, causal=True, hidden_layers=None):
        assert causal and hidden_layers == self.layers
        start = cache.length
        cache.tokens += x[0].tolist()
        cache.length = len(cache.tokens)
        rows = [self.table[tuple(cache.tokens[:t + 1])] for t in range(start, cache.length)]
        hidden = [torch.stack([r[1][i] for r in rows])[None] for i in range(len(self.layers))]
        return torch.stack([r[0] for r in rows])[None], hidden


class TreeTableTarget(TableTarget):
    """TableTarget for tree forwards: row i answers as the Transformer does for the tokens it may see
    (the cached ones and the new ones its mask allows, in order), and its position id must be the
    last of those; the cache keeps rows like KVCache.keep. The real mask, positions and cache are
    proven by test_ddtree's other tests; this proves the walk, the sampling and the bookkeeping."""

    def new_cache(self, batch_size=1):
        return TreeTokenCache()

    def forward(self, x, pos=None, mask=None, cache=None, causal=True, hidden_layers=None):
        assert hidden_layers == self.layers
        start, T = cache.length, x.shape[1]
        if mask is None:
            assert causal and pos is None
            mask = torch.ones(T, start + T, dtype=torch.bool).tril(start)
        cache.tokens += x[0].tolist()
        cache.length = len(cache.tokens)
        rows = []
        for i in range(T):
            seen = [t for t, visible in zip(cache.tokens, mask[i].tolist()) if visible]
            assert mask[i, start + i] and (pos is None or int(pos[i]) == len(seen) - 1)
            rows.append(self.table[tuple(seen)])
        hidden = [torch.stack([r[1][j] for r in rows])[None] for j in range(len(self.layers))]
        return torch.stack([r[0] for r in rows])[None], hidden


class Oracle:
    """Makes a drafter draft from the target itself: slot k gets the target's logits for position
    start + k after the committed sequence followed by the target's own greedy continuation, so at
    temperature 0 every draft is the target's argmax. `wrong(position)` marks slots to corrupt (their
    argmax moves to another token). It learns the committed sequence from on_round; call
    reset(prompt) before each generation. It also checks that each block starts at the newest token."""

    def __init__(self, drafter, target, wrong=lambda position: False):
        self.drafter, self.target, self.wrong, self.memo, self.seq = drafter, target, wrong, {}, None
        drafter.register_forward_hook(self.hook)

    def reset(self, prompt):
        self.seq = list(prompt)
        return self

    def on_round(self, info):
        self.seq = info["seq"]

    def chain(self, n):
        key = (tuple(self.seq), n)
        if key not in self.memo:
            seq, rows = list(self.seq), []
            for _ in range(n):
                rows.append(self.target(torch.tensor([seq]), causal=True, head_from=len(seq) - 1)[0, -1])
                seq.append(int(next_token_probs(rows[-1].clone(), 0, None, None).argmax()))
            self.memo[key] = torch.stack(rows), seq[len(self.seq):]
        return self.memo[key]

    def hook(self, module, args, output):
        block, pos = args[0], args[1]
        start = len(self.seq) - 1
        assert pos.tolist() == list(range(start, start + block.shape[1])) and block[0, 0] == self.seq[-1]
        rows, tokens = self.chain(block.shape[1] - 1)
        out = output.clone()
        out[0, 1:] = rows
        for k, token in enumerate(tokens, 1):
            if self.wrong(start + k):
                out[0, k, (token + 1) % min(out.shape[-1], MASK)] = rows[k - 1].max() + 10.0
        return out


class TreeOracle(Oracle):
    """Oracle (slot k: the target's logits after its own greedy continuation), made sure of itself
    for trees: the target's pick gets +SHARP, so the greedy path outscores every other prefix by
    ~SHARP nats. Where wrong(position), a decoy gets the pick's logit + 1 instead: the target's pick
    is rank 1 there, so a single path (DFlash) stops at the decoy and a tree that keeps both
    branches (2^decoys paths down to depth B-1) holds the target's whole path."""
    SHARP = 20.0

    def hook(self, module, args, output):
        out = super().hook(module, args, output)  # the plain oracle, decoys at +10 (replaced here)
        start = len(self.seq) - 1
        rows, tokens = self.chain(args[0].shape[1] - 1)
        out[0, 1:] = rows
        for k, token in enumerate(tokens, 1):
            out[0, k, token] += self.SHARP
            if self.wrong(start + k):
                out[0, k, (token + 1) % min(out.shape[-1], MASK)] = out[0, k, token] + 1
        return out
