"""EAGLE-3: a one-layer draft head that reads the target's features, and its loop.

Paper: Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test" (reference code SafeAILab/EAGLE); the dynamic tree is EAGLE-2's (Li et al. 2024).
The head is one Transformer block of its own around the target's *frozen* embedding and LM head. Its
row t reads [embedding of token t+1, a feature of position t] at position t+1 and predicts token t+2
(the feature says where the text was heading, the token which way it went):
  step 0    the feature is the target's: its residual streams after a low, a mid and a high block
            (`eagle_layers`), concatenated (3D) and fused by `Linear(3D -> D)`;
  step i>0  past the committed text there is no target feature yet: the head feeds its own output
            hidden state of step i-1 instead, with the token it drafted there;
  input     `Linear(2D -> D)` on [RMSNorm(embedding), RMSNorm(feature)], then one causal block over
            explicit keys/values (dflash.ExtraKVBlock); committed rows' K/V sit in a KVCache;
  training  the "training-time test" (`eagle_loss`): the head unrolled K steps on its own hidden
            states, each step's rows seeing the keys its draft step sees at inference (`unroll_mask`).
Decoding, each round with committed seq (S tokens), both caches holding seq[:-1] and `ready` the
head's logits for token S and the hidden state that goes with them:
  chain     (eagle_chain_generate) d_1 ~ warp(ready); draft j >= 2 reads [d_{j-1}, the hidden of step
            j-1]: k-1 head forwards. The target reads [seq[-1], d_1..d_k] in one forward; speculation's
            rule (speculative.verify) keeps the output the target's distribution, greedy at T = 0;
  tree      (eagle_tree_generate, a budget of N nodes) EAGLE-2's dynamic tree: each depth, every frontier
            node offers its top `branch` children (scored by the sum of the head's log-probs along the
            path), the best `branch` of them form the next frontier, read by one head forward (a node sees
            the committed rows, its ancestors and itself); after k depths the best N nodes are kept. Verified as a
            DDTree: ddtree.compile_tree / follow_tree / compact_cache, lossless at every temperature;
  commit    the target cache is cropped (chain) or compacted (tree); the head reads the committed rows
            with the verify forward's target features in one forward, which gives the next `ready`.
The target is *held*, not registered (as in dflash.py): a head checkpoint is the head's weights alone.
Leaves out: the paper's reduced draft vocabulary, batches, adapting k or N on the fly.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinydiff.ar import check_prompt
from tinydiff.checks import DEPTH, MASS, UserError, check_fields
from tinydiff.ddtree import Tree, build_tree, check_budget, compact_cache, compile_tree, follow_tree
from tinydiff.dflash import (TARGET_RULES, ExtraKVBlock, check_drafter_config, check_target, checkpointed_chunks,
                             init_around, target_dims)
from tinydiff.model import KVCache, ModelConfig, RMSNorm, Transformer, check_heads, rope_table, tied_head, wide
from tinydiff.sampling import check_warp_args, draftable, next_token_probs, sample, soft_ce
from tinydiff.speculative import Tally, cut_at_stop, verify
from tinydiff.tokenizer import EOT, VOCAB_SIZE

KIND = "eagle3"  # the checkpoint kind


def eagle_layers(n_layer: int) -> list[int]:
    """The low, mid and high target layers read (ids as in Transformer.forward(hidden_layers=)): after
    blocks 2, L//2 and L-3 as the reference (L = 32: [2, 16, 29]); under 8 blocks 1, (L+1)//2 and L."""
    if n_layer < 1:
        raise UserError(f"the target needs >= 1 layer, got {n_layer}")
    return [2, n_layer // 2, n_layer - 3] if n_layer >= 8 else [1, (n_layer + 1) // 2, n_layer]


@dataclass
class EagleConfig:
    feature_layers: list | None = None  # the 3 target layers fused at step 0; None: eagle_layers(L)
    steps_ahead: int = 3            # K: training unrolls the head K steps (1 = no training-time test)
    step_decay: float = 0.8         # step i's loss weight is step_decay^i
    # The target's dimensions: the head must be used with a target that matches them.
    vocab_size: int = VOCAB_SIZE    # the target's vocabulary (its embedding and head are borrowed)
    context: int = 256              # the target's context
    d_model: int = 192              # the target's residual width (features and head share it)
    target_layers: int = 8          # L, the target's blocks (feature ids refer to them)
    n_head: int = 6                 # heads of the head's block (the target's, by default)
    d_ff: int = 512                 # SwiGLU width of the head's block (the target's, by default)
    rope_base: float = 10000.0      # RoPE base (the target's: positions must mean the same)
    norm_eps: float = 1e-5          # RMSNorm epsilon (the target's)

    def __post_init__(self):
        check_fields(self, TARGET_RULES, "EAGLE-3 config")
        if self.feature_layers is None:
            self.feature_layers = eagle_layers(self.target_layers)
        check_drafter_config(self, {"steps_ahead": DEPTH, "step_decay": MASS}, "EAGLE-3 config", self.target_layers)
        if len(self.feature_layers) != 3:
            raise UserError(f"feature_layers must be 3 ids (low, mid, high) in [0, {self.target_layers}], "
                            f"got {self.feature_layers}")

    @classmethod
    def for_target(cls, target_config: ModelConfig, **overrides) -> "EagleConfig":
        """A config that copies the target's dimensions."""
        return cls(**{**target_dims(target_config), **overrides})


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig, target: Transformer):
        super().__init__()
        check_target(config, target, "EAGLE head")
        object.__setattr__(self, "target", target)  # held, not registered: see the module docstring
        self.config = config
        D, H = config.d_model, config.n_head
        check_heads(D, H)
        self.layer_config = ModelConfig(vocab_size=config.vocab_size, context=config.context, n_layer=1,
                                        n_head=H, d_model=D, d_ff=config.d_ff, rope_base=config.rope_base,
                                        norm_eps=config.norm_eps)
        self.fuse = nn.Linear(3 * D, D, bias=False)  # low, mid, high target layers: 3D -> D
        # Target features and the head's own hidden states differ in scale: normalise both inputs.
        self.embed_norm = RMSNorm(D, config.norm_eps)
        self.feature_norm = RMSNorm(D, config.norm_eps)
        self.proj = nn.Linear(2 * D, D, bias=False)  # [embedding, feature]: 2D -> D
        self.block = ExtraKVBlock(self.layer_config)
        self.norm = RMSNorm(D, config.norm_eps)
        cos, sin = rope_table(config.context, D // H, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init_around(self, target, n_layer=1)  # one layer

    def new_cache(self, batch_size: int = 1) -> KVCache:
        """The block's K/V of committed rows (row t: feature of position t, token t+1)."""
        return KVCache(self.layer_config, batch_size, self.fuse.weight.device, self.fuse.weight.dtype)

    def fused(self, hidden):
        """Step 0's features (B, T, D) from the target's hidden states at the 3 feature layers (3 x (B, T, D))."""
        return self.fuse(torch.cat(hidden, -1))  # (B, T, 3D) -> (B, T, D)

    def forward(self, tokens, features, pos, past_k, past_v, mask=None):
        """Rows reading tokens (B, T) with features (B, T, D) at positions pos (T,), after earlier
        rows' keys/values past_k, past_v (B, H, S, D/H); mask: bool (T, S + T), True = may attend,
        or None (everything visible). Returns logits (B, T, V), hidden (B, T, D) (the next step's
        feature) and the rows' own k, v (B, H, T, D/H)."""
        h, k, v = self.hidden(tokens, features, pos, past_k, past_v, mask)
        return self.logits(h), h, k, v

    def hidden(self, tokens, features, pos, past_k, past_v, mask=None):
        """`forward` without the head: hidden (B, T, D), k, v (training reads the logits a chunk at a time)."""
        x = torch.cat([self.embed_norm(F.embedding(tokens, self.target.embed.weight.detach())),  # borrowed, frozen
                       self.feature_norm(features)], -1)  # (B, T, 2D)
        cos, sin = (c[pos][None, None] for c in (self.rope_cos, self.rope_sin))  # (1, 1, T, D/H/2)
        return self.block(self.proj(x), cos, sin, past_k, past_v, mask)  # (B, T, D), k, v

    def logits(self, h):
        """The target's tied head on the head's hidden states h (..., D): (..., V)."""
        return tied_head(self.norm(h), self.target.embed.weight.detach(), self.config.vocab_size)

    def extend(self, cache: KVCache, tokens, hidden):
        """Append committed rows: tokens (1, T) are the tokens after the positions whose target hidden
        states (3 x (1, T, D)) are given. Returns the last row's logits (V,) and hidden state (D,):
        the first draft of the next round and the feature that goes with it."""
        n = cache.length
        T = tokens.shape[1]
        pos = torch.arange(n + 1, n + 1 + T, device=tokens.device)  # row t reads token t+1
        mask = torch.ones(T, n + T, dtype=torch.bool, device=tokens.device).tril(n)  # causal after the cache
        logits, h, k, v = self(tokens, self.fused(hidden), pos, *committed_kv(cache), mask)
        cache.write(0, cache.rows(T), k, v)
        cache.advance(T)
        return logits[0, -1], h[0, -1]


def committed_kv(cache):
    """The committed rows' keys and values, (1, H, S-1, D/H) each."""
    return cache.k[0][:, :, :cache.length], cache.v[0][:, :, :cache.length]


# ---- training: the training-time test, the head unrolled on its own features

def unroll_mask(T: int, step: int, device=None):
    """Who row r of unroll step i may attend to: (T, (i+1)T) bool over [step 0 | step 1 | ... | step i].

    Row r at step i is draft step i+1 after the committed row c = r - i: as at inference it sees
    step 0's rows 0..c (the committed rows, read with target features) and from each step m = 1..i
    the single row c + m (the m-th draft row of its own chain; m = i is the row itself). Rows r < i
    have no committed row; they see only themselves and feed no loss.
    """
    r = torch.arange(T, device=device)[:, None]
    c = torch.arange(T, device=device)[None]
    anchored = r >= step
    return torch.cat([c <= r - step] + [(c == r - step + m) & (anchored | (m == step)) for m in range(1, step + 1)], 1)


def unrolled_hidden(head: EagleHead, windows, steps: int):
    """The head unrolled `steps` steps on windows (Bw, T): its hidden states, (Bw, steps, T-1, D) (row r's
    logits predict token r+2), and the target's last residual stream (Bw, T, D), one frozen target forward.
    No logits: at 50,258 a row, eagle_loss reads them a chunk of rows at a time."""
    Bw, T = windows.shape
    with torch.no_grad():  # head_from=T: the target's head is left for the loss to run on `last`
        _, hidden = head.target(windows, causal=True, head_from=T,
                                hidden_layers=[*head.config.feature_layers, head.config.target_layers])
    last = hidden.pop()
    tokens = windows[:, 1:]  # row r reads token r+1
    pos = torch.arange(1, T, device=windows.device)
    features = head.fused([h[:, :-1] for h in hidden])  # (Bw, T-1, D): row r's is position r's
    D, H = head.config.d_model, head.config.n_head
    past_k = past_v = features.new_zeros(Bw, H, 0, D // H)
    out = []
    for i in range(steps):
        h, k, v = head.hidden(tokens, features, pos, past_k, past_v, unroll_mask(T - 1, i, windows.device))
        past_k, past_v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)  # (Bw, H, (i+1)(T-1), D/H)
        out.append(h)
        features = F.pad(h[:, :-1], (0, 0, 1, 0))  # row r's next feature: row r-1's hidden (row 0: none)
    return torch.stack(out, 1), last  # (Bw, steps, T-1, D)


def unrolled_logits(head: EagleHead, windows, steps: int):
    """unrolled_hidden's logits: the head's per step, steps x (Bw, T-1, V), and the target's (Bw, T, V)."""
    hidden, last = unrolled_hidden(head, windows, steps)
    with torch.no_grad():
        target_logits = head.target.logits(last)
    return list(head.logits(hidden).unbind(1)), target_logits


def eagle_loss(head: EagleHead, windows, generator=None, steps=None, temperature: float = 1.0):
    """Training-time-test distillation loss on windows (Bw, T); returns (loss, stats).

    loss = sum_i w_i CE_i / sum_i w_i, w_i = step_decay^i over steps i = 0..K-1 (K = steps, default
    config.steps_ahead), CE_i the mean over rows r >= i of the cross-entropy of step i's row r
    against the target's distribution for token r+2, both read at `temperature` (1 by default,
    --draft-temperature's for a head trained for sampling there). `generator` is unused (kept for train.py's
    one loss signature). stats: ce (the loss), acc (step 0's argmax == the target's), acc_last
    (the same at step K-1), tau_proxy (1 + the mean run of leading correct steps per committed
    row: the greedy tau at k = K if the target's picks were the data).
    Memory: the logits of a few windows at a time (dflash.checkpointed_chunks), made again in the
    backward, so the batch's (Bw, K, T-1, V) logits never exist at once.
    """
    K = head.config.steps_ahead if steps is None else steps
    Bw, T = windows.shape
    check_unroll(K, T)
    hidden, last = unrolled_hidden(head, windows, K)  # (Bw, K, T-1, D), (Bw, T, D)
    w = torch.tensor([head.config.step_decay ** i for i in range(K)], dtype=torch.float64)
    rows = torch.arange(T - 1)
    weight = torch.stack([(rows >= i) * wi / (w.sum() * Bw * (T - 1 - i)) for i, wi in enumerate(w)])  # (K, T-1)
    weight = weight.to(windows.device, wide(hidden.dtype))  # row r >= i's share of step i's mean

    def chunk_loss(hidden, last):  # a few windows' share of the loss (checkpointed_chunks)
        with torch.no_grad():
            p = next_token_probs(head.target.logits(last[:, 1:]), temperature)  # (b, T-1, V): for token r+2
        logits = head.logits(hidden)  # (b, K, T-1, V)
        loss = (soft_ce(logits / temperature, p[:, None]) * weight).sum()
        return loss, draftable(logits.detach()).argmax(-1) == p[:, None].argmax(-1)  # (b, K, T-1)

    parts = checkpointed_chunks(chunk_loss, K * (T - 1), hidden, last)
    loss = sum(part for part, _ in parts)
    correct = torch.cat([right for _, right in parts]).transpose(0, 1)  # (K, Bw, T-1)
    runs = torch.stack([correct[i, :, i:T - K + i] for i in range(K)]).long()  # (K, Bw, T-K): row c's chain
    acc_last = correct[-1, :, K - 1:].float().mean()  # step K-1's rows that have a committed row
    return loss, {"ce": loss.detach(), "acc": correct[0].float().mean(), "acc_last": acc_last,
                  "tau_proxy": 1 + runs.cumprod(0).sum(0).float().mean()}


# ---- decoding: drafts, a chain or a tree

def draft_chain(head: EagleHead, cache, ready, n_drafts: int, warp_args, generator=None):
    """n_drafts tokens sampled from the head: d_1 from the ready logits, then one head forward per further
    draft (its rows' keys kept here, never in the cache). Returns drafts (K,), their warped distributions
    q (K, V) and the head's raw logits (K, V)."""
    device = head.fuse.weight.device
    if not n_drafts:  # the last round may have no room for drafts, the first none to draft from
        none = torch.empty(0, head.config.vocab_size, device=device)
        return torch.empty(0, dtype=torch.long, device=device), none, none
    logits, hidden = ready  # (V,), (D,)
    n = cache.length
    past_k, past_v = committed_kv(cache)
    drafts, qs, raw = [], [], []
    for j in range(n_drafts):
        if j:  # read d_j (at position n + j) with the hidden state of the step that drafted it
            pos = torch.tensor([n + j], device=device)
            lg, h, k, v = head(drafts[-1].view(1, 1), hidden.view(1, 1, -1), pos, past_k, past_v)
            past_k, past_v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
            logits, hidden = lg[0, -1], h[0, -1]
        q = next_token_probs(logits, *warp_args)  # (V,)
        drafts.append(sample(q, generator))
        qs.append(q)
        raw.append(logits)
    return torch.stack(drafts), torch.stack(qs), torch.stack(raw)


def log_probs(logits):
    """The head's log-probabilities (..., V), MASK excluded (never drafted)."""
    return torch.log_softmax(draftable(logits), -1)


def draft_tree(head: EagleHead, cache, ready, depth: int, branch: int, budget: int):
    """EAGLE-2's dynamic tree of up to `budget` nodes and `depth` levels from the ready logits. Returns
    (ddtree.Tree, head forwards spent: depth - 1); nodes are numbered best-first (score descending, ties
    by creation), so a parent precedes its children, as in ddtree's trees."""
    n = cache.length
    device = ready[1].device
    past_k, past_v = committed_kv(cache)
    tokens, parents, depths, scores = [-1], [-1], [0], [0.0]  # every node offered; 0 is the root
    row_of = {}  # node -> its row among the tree rows read
    hidden_of = {0: ready[1]}  # node -> its hidden state
    frontier = [0]
    logits = ready[0][None]  # (F, V)
    forwards = 0
    for d in range(1, depth + 1):
        top = torch.topk(log_probs(logits), min(branch, logits.shape[-1]), -1)  # (F, branch): distinct children
        offered = []
        for node, values, ids in zip(frontier, top.values.tolist(), top.indices.tolist()):
            for value, token in zip(values, ids):
                if value > float("-inf"):  # probability 0 (MASK): never a node
                    tokens.append(token)
                    parents.append(node)
                    depths.append(d)
                    scores.append(scores[node] + value)
                    offered.append(len(tokens) - 1)
        if d == depth:
            break
        frontier = sorted(offered, key=lambda i: -scores[i])[:branch]  # stable: ties keep creation order
        F_ = len(frontier)
        R = len(row_of)
        mask = torch.zeros(F_, n + R + F_, dtype=torch.bool)
        mask[:, :n] = True  # the committed rows
        for f, node in enumerate(frontier):
            mask[f, n + R + f] = True  # itself
            a = parents[node]
            while a > 0:  # its ancestors' rows (the root is the newest committed row, already visible)
                mask[f, n + row_of[a]] = True
                a = parents[a]
        ids = torch.tensor([[tokens[i] for i in frontier]], device=device)  # (1, F)
        feats = torch.stack([hidden_of[parents[i]] for i in frontier])[None]  # (1, F, D)
        pos = torch.full((F_,), n + d, device=device)  # a depth-d token sits at position S-1+d
        lg, h, k, v = head(ids, feats, pos, past_k, past_v, mask.to(device))
        forwards += 1
        past_k, past_v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        for f, node in enumerate(frontier):
            row_of[node] = R + f
            hidden_of[node] = h[0, f]
        logits = lg[0]  # (F, V)
    keep = [0] + sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[:budget]
    index = {node: i for i, node in enumerate(keep)}
    visibility = torch.zeros(len(keep), len(keep), dtype=torch.bool)
    visibility[0, 0] = True
    for i in range(1, len(keep)):  # parents come first: row i = row parent(i) plus i itself
        visibility[i] = visibility[index[parents[keep[i]]]]
        visibility[i, i] = True
    tree = Tree(torch.tensor([tokens[i] for i in keep]), torch.tensor([depths[i] for i in keep]),
                torch.tensor([-1] + [index[parents[i]] for i in keep[1:]]),
                torch.tensor([scores[i] for i in keep], dtype=torch.float64), visibility)
    return tree, forwards


@torch.no_grad()
def eagle_generate(target, head, prompt, max_new_tokens, k=4, budget=None, branch=4, temperature=0.0, top_k=None,
                   top_p=None, generator=None, stop_token=EOT, on_round=None):
    """Decode after `prompt` (list of ids): chains of k drafts (budget None: eagle_chain_generate) or trees of up
    to `budget` nodes, k deep and `branch` wide (eagle_tree_generate); their arguments and results."""
    if budget is None:
        return eagle_chain_generate(target, head, prompt, max_new_tokens, k, temperature, top_k, top_p, generator,
                                    stop_token, on_round)
    return eagle_tree_generate(target, head, prompt, max_new_tokens, k, budget, branch, temperature, top_k, top_p,
                               generator, stop_token, on_round)


@torch.no_grad()
def eagle_chain_generate(target, head, prompt, max_new_tokens, k=4, temperature=0.0, top_k=None, top_p=None,
                         generator=None, stop_token=EOT, on_round=None):
    """Decode after `prompt` (list of ids), chains of k drafts, 1..k+1 tokens a round, until max_new_tokens (None:
    the context) or stop_token (None: never; the round's tokens after it dropped). on_round(info) after every
    round: drafts, accepted, tokens, seq, target_cache, draft_cache. Returns (new ids, speculative.Speculated):
    forwards = rounds + the prefill, draft_forwards = head forwards, the reads of committed rows included."""
    warp_args = (temperature, top_k, top_p)
    n_new = check_decoding(target, head, prompt, max_new_tokens, k, warp_args)
    device = target.embed.weight.device
    tally = Tally(k)
    target_cache, head_cache, ready = prefill(target, head, prompt, tally)
    seq = list(prompt)
    out = []
    while len(out) < n_new:
        depth = 0 if ready is None else min(k, n_new - len(out) - 1)  # full depth plus the bonus lands on n_new
        drafts, q, _ = draft_chain(head, head_cache, ready, depth, warp_args, generator)  # (K,), (K, V)
        x = torch.cat([torch.tensor([seq[-1]], device=device), drafts])[None]  # (1, K+1)
        logits, hidden = target(x, cache=target_cache, causal=True, hidden_layers=head.config.feature_layers)
        n, token = verify(next_token_probs(logits[0], *warp_args), q, drafts, generator)
        tokens, stopped = cut_at_stop(drafts[:n].tolist() + [token], stop_token)  # commit
        seq += tokens
        out += tokens
        target_cache.crop(len(seq) - 1)  # the newest token is read next round
        ready = head.extend(head_cache, torch.tensor([tokens], device=device), [h[:, :len(tokens)] for h in hidden])
        tally.add(n, depth, max(0, depth - 1) + 1)  # + the head's read of the committed rows
        if on_round is not None:
            on_round({"drafts": drafts.tolist(), "accepted": n, "tokens": tokens, "seq": list(seq),
                      "target_cache": target_cache, "draft_cache": head_cache})
        if stopped:
            break
    return out, tally.result(out, device)


@torch.no_grad()
def eagle_tree_generate(target, head, prompt, max_new_tokens, k=4, budget=32, branch=4, temperature=0.0, top_k=None,
                        top_p=None, generator=None, stop_token=EOT, on_round=None):
    """eagle_chain_generate with trees of up to `budget` nodes, k deep and `branch` wide, instead of chains:
    on_round's info holds tree and path instead of drafts, Speculated's proposed counts tree nodes."""
    warp_args = (temperature, top_k, top_p)
    n_new = check_decoding(target, head, prompt, max_new_tokens, k, warp_args, budget, branch)
    device = target.embed.weight.device
    tally = Tally(k, chain=False)
    target_cache, head_cache, ready = prefill(target, head, prompt, tally)
    seq = list(prompt)
    out = []
    while len(out) < n_new:
        depth = 0 if ready is None else min(k, n_new - len(out) - 1)  # full depth plus the bonus lands on n_new
        start = target_cache.length  # = len(seq) - 1
        if depth:
            room = target.config.context - len(seq)
            tree, spent = draft_tree(head, head_cache, ready, depth, branch, min(budget, room))
        else:  # no depth: the root alone, the target's one sample
            tree = build_tree(torch.empty(0, 1), 1)
            spent = 0
        ids, pos, mask = compile_tree(tree, start, seq[-1], device)
        logits, hidden = target(ids, pos=pos, mask=mask, cache=target_cache, hidden_layers=head.config.feature_layers)
        path, token = follow_tree(tree, lambda i: next_token_probs(logits[0, i], *warp_args), generator)
        tokens, stopped = cut_at_stop(tree.tokens[path].tolist() + [token], stop_token)  # commit
        seq += tokens
        out += tokens
        rows = [0, *path][:len(tokens)]  # the verify rows now committed (the newest token is read next round)
        if rows == list(range(len(rows))):  # a prefix of the verify rows: nothing to move
            target_cache.crop(start + len(rows))
        else:
            compact_cache(target_cache, start, rows[1:])
        ready = head.extend(head_cache, torch.tensor([tokens], device=device), [h[:, rows] for h in hidden])
        tally.add(len(path), tree.size, spent + 1, int(tree.depths.max()))  # + the head's read of the committed rows
        if on_round is not None:
            on_round({"tree": tree, "path": path, "accepted": len(path), "tokens": tokens, "seq": list(seq),
                      "target_cache": target_cache, "draft_cache": head_cache})
        if stopped:
            break
    return out, tally.result(out, device)


def prefill(target, head, prompt, tally):
    """Both loops' start: the target reads prompt[:-1], the head its features (one forward each, counted in
    tally). Returns the target's and the head's caches and `ready` (None for a one-token prompt)."""
    target_cache = target.new_cache(1)
    head_cache = head.new_cache(1)
    if len(prompt) < 2:
        return target_cache, head_cache, None
    device = target.embed.weight.device
    _, hidden = target(torch.tensor([prompt[:-1]], device=device), cache=target_cache,
                       hidden_layers=head.config.feature_layers)
    ready = head.extend(head_cache, torch.tensor([prompt[1:]], device=device), hidden)
    tally.prefill = 1
    tally.draft_forwards = 1
    return target_cache, head_cache, ready


# ---- the checks

def check_decoding(target, head, prompt, max_new_tokens, k, warp_args, budget=None, branch=None) -> int:
    """The loops' arguments (budget and branch: the tree's); returns how many new tokens to decode."""
    check_warp_args(*warp_args)
    n_new = check_prompt(prompt, target.config.context, max_new_tokens)
    if not isinstance(head, EagleHead):
        raise UserError(f"the head is a {type(head).__name__}; build a tinydiff.eagle3.EagleHead or load an "
                        "EAGLE-3 checkpoint (train.py --model eagle3)")
    check_target(head.config, target, "EAGLE head")
    if head.fuse.weight.device != target.embed.weight.device:
        raise UserError(f"the head is on {head.fuse.weight.device} but the target on "
                        f"{target.embed.weight.device}; move both to one device")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise UserError(f"k (drafts per round, the tree's depth) must be an integer >= 1, got {k!r}")
    if budget is not None:
        check_budget(budget)
    if branch is not None and (not isinstance(branch, int) or isinstance(branch, bool) or branch < 1):
        raise UserError(f"branch (children per tree node and frontier width) must be an integer >= 1, got {branch!r}")
    return n_new


def check_unroll(steps, T: int):
    """The training-time test unrolls an integer >= 1 of steps, within the windows."""
    if not isinstance(steps, int) or steps < 1:
        raise UserError(f"steps (unrolled draft steps) must be an integer >= 1, got {steps!r}")
    if T < steps + 1:
        raise UserError(f"windows of {T} tokens are too short to unroll {steps} steps; use windows of >= {steps + 1}")
