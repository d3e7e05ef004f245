"""DFlash: a block-diffusion drafter that drafts a whole block in one forward, its loss, and its loop.

Paper: "DFlash: Block Diffusion for Flash Speculative Decoding" (2026); reference code z-lab/dflash.
The drafter is a few Transformer layers of its own around the target's *frozen* embedding and tied
head (read through `.detach()`). It fills a block `[last committed token, MASK x (B-1)]` in one
bidirectional forward, slot k predicting the token at position start + k, reading the target's
hidden states: the outputs of blocks `feature_layers(L, N)`, concatenated, Linear(N*D -> D), RMSNorm,
one vector per committed position, which every drafter layer projects with its own k/v weights.
Training (`dflash_loss`): random anchors' blocks packed in ONE drafter forward (`training_mask`: a block
sees the context before its anchor and itself), slot k's CE weighted exp(-(k-1)/g).
Each decoding round (both caches holding the committed sequence but its last token):
  1. draft:  the drafter fills the block in ONE forward; the drafts are its argmax;
  2. verify: the target reads [last token, d_1..d_K] in ONE forward, which also gives the features;
  3. match:  the target samples y_0..y_K from its own warped distributions; drafts are kept while
             d_i == y_{i-1}, then y_n is committed: every token is a target sample given its prefix,
             so the output is the target's distribution for any draft (greedy: token for token);
  4. commit: the target's cache is cropped, the drafter's grows by the new tokens' features.
The target is *held*, not registered: a drafter checkpoint is the drafter alone.
Variants (tinydiff/extras/): sampled drafts and the rejection rule, DSpark's verify length (dflash_reject.py),
DSpark's Markov head (markov_head.py). Leaves out: the paper's scale (5 layers reading 5 features of a
36-layer target, hundreds of anchors a sequence), batches.
"""
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tinydiff.ar import check_prompt, split_time
from tinydiff.checks import BLOCK, DEPTH, POSITIVE, SIZE, Rule, UserError, check_fields
from tinydiff.model import (
    RULES,
    Block,
    KVCache,
    ModelConfig,
    RMSNorm,
    Transformer,
    check_heads,
    gpt2_init_,
    heads,
    rope_table,
    tied_head,
    wide,
)
from tinydiff.sampling import check_warp_args, forbid_mask, next_token_probs, sample, tempered_ce
from tinydiff.speculative import Tally, cut_at_stop
from tinydiff.tokenizer import EOT, MASK, VOCAB_SIZE

PUBLISHED_DECAY = {8: 4.0, 10: 5.0, 16: 7.0}  # block size B -> loss decay g (the paper's choices)
# The target's dimensions a drafter's config copies (DFlash's, EAGLE-3's), checked as the target's are.
TARGET_RULES = {**{key: RULES[key] for key in ("vocab_size", "context", "d_model", "n_head", "d_ff", "rope_base",
                                               "norm_eps")}, "target_layers": RULES["n_layer"]}


def feature_layers(n_layer: int, n: int) -> list[int]:
    """Target blocks to read: N evenly spaced from 1 to L-3 (rounded); N = 1 gives [L // 2]. Id i is the
    output of 0-indexed block i (Hugging Face's hidden_states[i + 1]). L = 36, N = 5 -> [1, 9, 17, 25, 33]."""
    if n_layer < 1 or n < 1:
        raise UserError(f"need a target of >= 1 layer and >= 1 feature layer, got L={n_layer}, N={n}")
    if n == 1:
        return [n_layer // 2]
    if n > n_layer - 3:
        raise UserError(f"a {n_layer}-layer target has {max(0, n_layer - 3)} layers in 1..L-3 to read; "
                        f"use n_features <= {max(1, n_layer - 3)}")
    return [round(1 + i * (n_layer - 4) / (n - 1)) for i in range(n)]


def default_decay(block_size: int) -> float:
    """The paper's g for B = 8, 10, 16; otherwise linear through the nearest two of them, at least 1."""
    points = sorted(PUBLISHED_DECAY.items())
    (b0, g0), (b1, g1) = points[:2] if block_size < 10 else points[1:]
    return max(1.0, g0 + (block_size - b0) * (g1 - g0) / (b1 - b0))


def target_dims(t: ModelConfig) -> dict:
    """The target dimensions a drafter built around it copies (DFlash here, EAGLE-3 too)."""
    return dict(vocab_size=t.vocab_size, context=t.context, d_model=t.d_model, target_layers=t.n_layer,
                n_head=t.n_head, d_ff=t.d_ff, rope_base=t.rope_base, norm_eps=t.norm_eps)


@dataclass
class DFlashConfig:
    n_layer: int = 1                # drafter Transformer layers (1-2 at our scale)
    block_size: int = 16            # B: slot 0 = last committed token, slots 1..B-1 = MASK to fill
    n_features: int = 5             # N: target layers read (capped at L-3, or 1); the paper uses 5
    feature_layers: list | None = None  # their ids (the output of block i); None: feature_layers(L, N)
    loss_decay: float | None = None  # g in exp(-(k-1)/g); None: 7 for B=16, 5 for 10, 4 for 8, else interpolated
    anchors: int = 32               # training: most random blocks per window (at most T - B)
    # The target's dimensions: the drafter must be used with a target that matches them.
    vocab_size: int = VOCAB_SIZE    # the target's vocabulary (its embedding and head are borrowed)
    context: int = 256              # the target's context
    d_model: int = 192              # the target's residual width (features and block share it)
    target_layers: int = 8          # L, the target's blocks (feature ids refer to them)
    n_head: int = 6                 # heads of each drafter layer (the target's, by default)
    d_ff: int = 512                 # SwiGLU width of each drafter layer (the target's, by default)
    rope_base: float = 10000.0      # RoPE base (the target's: positions must mean the same)
    norm_eps: float = 1e-5          # RMSNorm epsilon (the target's)

    def __post_init__(self):
        check_fields(self, {**TARGET_RULES, "n_layer": DEPTH, "n_features": SIZE}, "DFlash config")
        if self.feature_layers is None:
            self.feature_layers = feature_layers(self.target_layers, self.n_features)
        if self.loss_decay is None:
            self.loss_decay = default_decay(self.block_size)
        check_drafter_config(self, {"block_size": BLOCK, "anchors": SIZE, "loss_decay": POSITIVE}, "DFlash config",
                             self.target_layers - 1)
        self.n_features = len(self.feature_layers)

    @property
    def taps(self) -> list[int]:
        """The feature layers as `Transformer.forward(hidden_layers=)` counts them (after i + 1 blocks)."""
        return [i + 1 for i in self.feature_layers]

    @classmethod
    def for_target(cls, target_config: ModelConfig, **overrides) -> "DFlashConfig":
        """A config that copies the target's dimensions; N defaults to min(5, L-3) (at least 1)."""
        return cls(**{**target_dims(target_config), "n_features": max(1, min(5, target_config.n_layer - 3)),
                      **overrides})


def init_around(drafter: nn.Module, target: Transformer, n_layer: int):
    """A drafter's own weights initialised as the target's were (residual writes scaled by sqrt(2 n_layer)),
    its final norm copied from the target's, and the drafter moved to the target's device."""
    gpt2_init_(drafter, n_layer)
    with torch.no_grad():
        drafter.norm.weight.copy_(target.norm.weight)
    drafter.to(target.embed.weight.device)


class ExtraKVBlock(Block):
    """model.py's Block reading [past keys; its own rows' keys], never caching its own (they are drafts)."""

    def forward(self, x, cos, sin, past_k, past_v, mask):
        B, T, D = x.shape
        q, k, v = self.attn.project(self.attn_norm(x), cos, sin)  # (B, H, T, D/H), RoPE applied
        keys, values = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)  # (B, H, S + T, D/H): the past first
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # no mask: every key is visible
        x = x + self.attn.wo(y.transpose(1, 2).reshape(B, T, D))
        return x + self.ffn(self.ffn_norm(x)), k, v


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig, target: Transformer):
        super().__init__()
        check_target(config, target)
        object.__setattr__(self, "target", target)  # held, not registered: see the module docstring
        self.config = config
        D, H = config.d_model, config.n_head
        self.layer_config = ModelConfig(vocab_size=config.vocab_size, context=config.context,
                                        n_layer=config.n_layer, n_head=H, d_model=D, d_ff=config.d_ff,
                                        causal=False, rope_base=config.rope_base, norm_eps=config.norm_eps)
        check_heads(D, H)
        self.fc = nn.Linear(config.n_features * D, D, bias=False)  # N*D -> D
        self.feature_norm = RMSNorm(D, config.norm_eps)
        self.layers = nn.ModuleList(ExtraKVBlock(self.layer_config) for _ in range(config.n_layer))
        self.norm = RMSNorm(D, config.norm_eps)
        # The MASK slots' input: our own vector, not the target's MASK row, which an AR target's tied head
        # trains only as an output that must never win (dev/LOG.md, "DFlash's MASK input").
        self.mask_embed = nn.Parameter(torch.zeros(D))
        # Blocks near the end of the context reach past it (their drafts are cut, not their input).
        cos, sin = rope_table(config.context + config.block_size, D // H, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        init_around(self, target, config.n_layer)

    def new_cache(self, batch_size: int = 1) -> KVCache:
        """Context K/V per drafter layer, for up to `context` committed positions."""
        return KVCache(self.layer_config, batch_size, self.fc.weight.device, self.fc.weight.dtype)

    def rope(self, pos):
        """cos, sin for position ids (T,) or (B, T), shaped to broadcast over (B, H, T, D/2)."""
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        return tuple(c.unsqueeze(-3) if c.dim() == 3 else c[None, None] for c in (cos, sin))

    def features(self, hidden):
        """Context vectors (B, T, D) from the target's hidden states at the feature layers (N x (B, T, D))."""
        return self.feature_norm(self.fc(torch.cat(hidden, -1)))

    def context_kv(self, ctx, pos):
        """Per drafter layer, the context's keys and values (B, H, T, D/H), RoPE'd at positions pos."""
        B, T, _ = ctx.shape
        cos, sin = self.rope(pos)
        out = []
        for layer in self.layers:
            k = heads(layer.attn.wk(ctx), layer.attn.n_head, cos, sin)  # (B, H, T, D/H), RoPE'd
            v = heads(layer.attn.wv(ctx), layer.attn.n_head)
            out.append((k, v))
        return out

    def extend(self, cache: KVCache, hidden):
        """Append the features of the next committed positions (hidden: N x (B, T, D)) to the cache."""
        T = hidden[0].shape[1]
        rows = cache.rows(T)  # (T,): the next rows are the next positions
        for i, (k, v) in enumerate(self.context_kv(self.features(hidden), rows)):
            cache.write(i, rows, k, v)
        cache.advance(T)

    def forward(self, block, pos, ctx_k, ctx_v, mask=None):
        """Logits (B, T, V) for block ids (B, T) at positions pos (T,) or (B, T). ctx_k, ctx_v: per layer
        (B, H, S, D/H) context keys/values; mask: bool over [S context rows; T block rows] (B, 1, T, S + T)
        or what broadcasts to it, True = may attend; None: everything visible."""
        return self.logits(self.hidden(block, pos, ctx_k, ctx_v, mask))

    def hidden(self, block, pos, ctx_k, ctx_v, mask=None):
        """`forward` without the head: (B, T, D) (training reads the logits a chunk at a time)."""
        is_mask = block == MASK  # (B, T)
        x = F.embedding(block.masked_fill(is_mask, 0), self.target.embed.weight.detach())  # (B, T, D); borrowed
        x = torch.where(is_mask[..., None], self.mask_embed.to(x.dtype), x)  # MASK may lie outside V
        cos, sin = self.rope(pos)
        for i, layer in enumerate(self.layers):
            x, _, _ = layer(x, cos, sin, ctx_k[i], ctx_v[i], mask)  # the context's keys first
        return x

    def logits(self, h):
        """The target's tied head on the drafter's hidden states h (..., D): (..., V)."""
        return tied_head(self.norm(h), self.target.embed.weight.detach(), self.config.vocab_size)


def block_input(last_token: int, block_size: int, device=None):
    """The block the drafter fills: [last committed token, MASK x (B-1)], shape (1, B)."""
    block = torch.full((1, block_size), MASK, dtype=torch.long, device=device)
    block[0, 0] = int(last_token)
    return block


def draft_block(drafter: DFlashDrafter, cache: KVCache, last_token: int, hidden=None, block_size=None):
    """Draft logits (B-1, V) for slots 1..B-1 of block_input, right after the cached context (the features
    of the newest committed positions, hidden: N x (1, T, D), appended first if given)."""
    if hidden is not None:
        drafter.extend(cache, hidden)
    B = block_size or drafter.config.block_size
    ctx_k, ctx_v, mask = cache.past(B)  # every row, the valid ones shown
    return drafter(block_input(last_token, B, cache.k[0].device), cache.rows(B), ctx_k, ctx_v, mask)[0, 1:]


# ---- training: every block of a window in one drafter forward

def sample_anchors(batch: int, T: int, block_size: int, anchors: int, generator=None, device=None):
    """min(anchors, T - B) distinct random anchors per window in [1, T - B], (batch, A): from 1, every block
    has context; up to T - B, its last slot's label is still in the window."""
    A = min(anchors, T - block_size)
    return torch.rand(batch, T - block_size, generator=generator, device=device).argsort(-1)[:, :A] + 1


def training_mask(anchors, block_size: int, T: int):
    """(Bw, A*B, T + A*B) bool for anchors (Bw, A): columns are the T context positions, then A blocks of B
    slots; a block's rows see the context strictly before its anchor and their own block, nothing else."""
    A = anchors.shape[1]
    row_anchor = anchors.repeat_interleave(block_size, 1)  # (Bw, A*B)
    sees_context = torch.arange(T, device=anchors.device) < row_anchor[..., None]  # (Bw, A*B, T)
    blocks = torch.arange(A * block_size, device=anchors.device) // block_size
    sees_block = (blocks[:, None] == blocks[None, :]).expand(len(anchors), -1, -1)  # (Bw, A*B, A*B)
    return torch.cat([sees_context, sees_block], -1)


def packed_hidden(drafter: DFlashDrafter, windows, anchors):
    """The drafter's hidden states (Bw, A, B-1, D) for the blocks at anchors (Bw, A) of windows (Bw, T), and the
    target's last residual stream (Bw, T, D): one frozen target forward for the features, ONE drafter forward
    for all blocks. No logits: at 50,258 a row, dflash_loss reads them a chunk of windows at a time."""
    Bw, T = windows.shape
    A = anchors.shape[1]
    B = drafter.config.block_size
    with torch.no_grad():  # head_from=T: the target's head is left for the loss to run on `last`
        _, hidden = drafter.target(windows, causal=True, head_from=T,
                                   hidden_layers=[*drafter.config.taps, drafter.config.target_layers])
    last = hidden.pop()
    kv = drafter.context_kv(drafter.features(hidden), torch.arange(T, device=windows.device))
    pos = (anchors[..., None] + torch.arange(B, device=windows.device)).flatten(1)  # (Bw, A*B)
    block = windows.gather(1, pos).view(Bw, A, B)
    block[:, :, 1:] = MASK  # [token at anchor, MASK x (B-1)] per block
    mask = training_mask(anchors, B, T)[:, None]  # (Bw, 1, A*B, T + A*B): shared by heads
    h = drafter.hidden(block.flatten(1), pos, [k for k, _ in kv], [v for _, v in kv], mask)  # (Bw, A*B, D)
    return h.view(Bw, A, B, -1)[:, :, 1:], last  # slot 0 holds the anchor's token: no prediction


def packed_logits(drafter: DFlashDrafter, windows, anchors):
    """packed_hidden's logits: the drafter's (Bw, A, B-1, V) and the target's (Bw, T, V)."""
    h, last = packed_hidden(drafter, windows, anchors)
    with torch.no_grad():
        target_logits = drafter.target.logits(last)
    return drafter.logits(h), target_logits


def block_loss(drafter: DFlashDrafter, windows, anchors, logits, target_logits, temperature: float | None = None):
    """The weighted block CE of logits (Bw, A, B-1, V) at anchors (Bw, A) of windows (Bw, T), and its stats."""
    Bw, A = anchors.shape
    B = drafter.config.block_size
    positions = (anchors[..., None] + torch.arange(1, B, device=windows.device)).flatten(1)  # (Bw, A*(B-1))
    labels = windows.gather(1, positions).view(Bw, A, B - 1)
    forbid_mask(logits, inplace=True)  # never a label, never drafted: keep no mass on it
    if temperature is None:
        ce = F.cross_entropy(logits.flatten(0, 2).to(wide(logits.dtype)), labels.flatten(), reduction="none")
    else:  # the target's distribution for slot k's position, predicted from the position before it
        V = target_logits.shape[-1]
        predicted = target_logits.gather(1, (positions - 1)[..., None].expand(-1, -1, V))  # (Bw, A*(B-1), V)
        ce = tempered_ce(logits, predicted.view(Bw, A, B - 1, V), temperature)
    ce = ce.view(Bw, A, B - 1)
    w = torch.exp(-torch.arange(B - 1, device=windows.device, dtype=ce.dtype) / drafter.config.loss_decay)
    loss = (ce * w).sum(-1).mean() / w.sum()  # slot k weighted exp(-(k-1)/g): nats per token whatever B is
    correct = (logits.argmax(-1) == labels).long()  # (Bw, A, B-1)
    return loss, {"ce": loss.detach(), "acc": correct[..., 0].float().mean(),
                  "tau_proxy": 1 + correct.cumprod(-1).sum(-1).float().mean()}


def dflash_loss(drafter: DFlashDrafter, windows, generator=None, temperature: float | None = None):
    """Weighted block CE on windows (Bw, T) of clean text: (loss, stats). Labels: the text's tokens, or with
    a `temperature` the target's distribution (sampling.tempered_ce). stats: ce, acc (slot 1's argmax right),
    tau_proxy (1 + the mean run of leading correct slots: greedy tau if the target's picks were the text).
    Memory: the logits of a few windows at a time (checkpointed_chunks), made again in the backward:
    a window of 256 tokens reads 32 blocks x 15 slots of 50,258 logits, 97 MB in float32."""
    B = drafter.config.block_size
    check_windows(windows, B)
    Bw = len(windows)
    anchors = sample_anchors(Bw, windows.shape[1], B, drafter.config.anchors, generator, windows.device)
    hidden, last = packed_hidden(drafter, windows, anchors)  # (Bw, A, B-1, D), (Bw, T, D)

    def chunk_loss(h, last, windows, anchors):  # summed over a chunk's windows (checkpointed_chunks)
        with torch.no_grad():
            target_logits = None if temperature is None else drafter.target.logits(last)  # (b, T, V)
        loss, stats = block_loss(drafter, windows, anchors, drafter.logits(h), target_logits, temperature)
        return loss * len(windows), {k: v * len(windows) for k, v in stats.items()}

    parts = checkpointed_chunks(chunk_loss, anchors.shape[1] * (B - 1), hidden, last, windows, anchors)
    loss = sum(part for part, _ in parts) / Bw
    return loss, {"ce": loss.detach(), **{k: sum(stats[k] for _, stats in parts) / Bw for k in ("acc", "tau_proxy")}}


LOSS_ROWS = 512  # rows a loss reads at once: each holds a few vectors of 50,258 floats (~0.2 MB each in float32)


def checkpointed_chunks(fn, rows_each: int, *tensors) -> list:
    """[fn(*chunk) for chunks of tensors along dim 0], a chunk about LOSS_ROWS rows of rows_each each, its graph
    run again in the backward (activation checkpointing): a loss over 50,258-wide logits (DFlash's, EAGLE-3's)
    holds one chunk's logits at a time, not the batch's."""
    n = max(1, LOSS_ROWS // rows_each)
    return [checkpoint(fn, *(t[i:i + n] for t in tensors), use_reentrant=False) for i in range(0, len(tensors[0]), n)]


# ---- decoding

def argmax_drafts(logits):
    """DFlash's drafts (K,): the drafter's argmax per slot of its block logits (K, V), never MASK."""
    return next_token_probs(logits, 0).argmax(-1)


def match(p, drafts, generator=None, greedy=False):
    """DFlash's rule: p (K+1, V) the target's warped distributions, drafts (K,) -> (n, token). The target
    samples y_i ~ p_i position by position; drafts are kept while d_i == y_i; `token` = y_n. Draws stop at
    the first mismatch. Greedy (one-hot p): every position at once, one read-back."""
    if greedy:
        y = p.argmax(-1)  # (K+1,)
        kept = (y[:-1] == drafts).cumprod(0).sum()  # () drafts before the first mismatch
        return tuple(torch.stack([kept, y[kept]]).tolist())
    for i in range(len(drafts) + 1):
        y = int(sample(p[i], generator))
        if i == len(drafts) or y != int(drafts[i]):
            return i, y


@torch.no_grad()
def dflash_generate(target, drafter, prompt, max_new_tokens, block_size=None, temperature=0.0, top_k=None,
                    top_p=None, generator=None, stop_token=EOT, on_round=None):
    """Decode after `prompt` (list of ids), each round drafting a block of block_size (default the drafter's
    B) and committing 1..B tokens, until max_new_tokens (None: the context) or stop_token (None: never).
    on_round(info) after every round. Returns (new ids, speculative.Speculated)."""
    warp_args = (temperature, top_k, top_p)
    device = target.embed.weight.device
    n_new, B, target_cache, draft_cache, prefill = start_decoding(target, drafter, prompt, max_new_tokens, block_size,
                                                                  warp_args)
    seq = list(prompt)
    out = []
    tally = Tally(B - 1, prefill=prefill)
    while len(out) < n_new:
        n_drafts = min(B - 1, n_new - len(out) - 1)  # a full acceptance plus the bonus lands on n_new
        t0 = time.perf_counter()
        drafts = torch.empty(0, dtype=torch.long, device=device)
        if n_drafts:  # 1. draft: ONE drafter forward for the block
            drafts = argmax_drafts(draft_block(drafter, draft_cache, seq[-1], block_size=B)[:n_drafts])  # (K,)
        t1 = split_time(device)
        x = torch.cat([torch.tensor([seq[-1]], device=device), drafts])[None]  # (1, K+1)
        logits, hidden = target(x, cache=target_cache, causal=True, hidden_layers=drafter.config.taps)  # 2. verify
        n, token = match(next_token_probs(logits[0], *warp_args), drafts, generator, temperature == 0)  # 3. match
        tally.clock(t0, t1, time.perf_counter())
        tokens, stopped = cut_at_stop(drafts.tolist()[:n] + [token], stop_token)  # 4. commit
        seq += tokens
        out += tokens
        target_cache.crop(len(seq) - 1)  # the newest token is read next round
        drafter.extend(draft_cache, [h[:, :len(tokens)] for h in hidden])
        tally.add(n, len(drafts), int(n_drafts > 0))  # one drafter forward per round that drafted
        if on_round is not None:
            on_round({"drafts": drafts.tolist(), "accepted": n, "tokens": tokens, "seq": list(seq),
                      "target_cache": target_cache, "draft_cache": draft_cache})
        if stopped:
            break
    return out, tally.result(out, device)


# ---- the loops' start, and the checks

def start_decoding(target, drafter, prompt, max_new_tokens, block_size, warp_args):
    """Every block-drafter loop's start (DFlash, DDTree, variants): checks, both caches filled by a target
    forward over prompt[:-1]. Returns (new tokens to decode, B, target_cache, draft_cache, prefill forwards)."""
    check_warp_args(*warp_args)
    n_new = check_prompt(prompt, target.config.context, max_new_tokens)
    if MASK in prompt:  # it would read as a MASK slot
        raise UserError(f"the prompt holds the MASK id {MASK}; pass text (MASK is only for diffusion canvases)")
    B = check_drafter(target, drafter, block_size)
    target_cache, draft_cache = target.new_cache(1), drafter.new_cache(1)
    if len(prompt) < 2:
        return n_new, B, target_cache, draft_cache, 0
    x = torch.tensor([prompt[:-1]], device=target.embed.weight.device)
    _, hidden = target(x, cache=target_cache, causal=True, hidden_layers=drafter.config.taps)
    drafter.extend(draft_cache, hidden)
    return n_new, B, target_cache, draft_cache, 1


def check_drafter(target, drafter, block_size) -> int:
    """The drafter is a DFlashDrafter built for this target's dimensions; returns the block size."""
    if not isinstance(drafter, DFlashDrafter):
        raise UserError(f"the drafter is a {type(drafter).__name__}; build a tinydiff.dflash.DFlashDrafter or "
                        "load a DFlash drafter checkpoint")
    check_target(drafter.config, target)
    block_size = drafter.config.block_size if block_size is None else block_size
    if not isinstance(block_size, int) or not 2 <= block_size <= drafter.config.block_size:
        raise UserError(f"block size must be an integer in [2, {drafter.config.block_size}] for this drafter "
                        f"(trained with blocks of {drafter.config.block_size}), got {block_size!r}")
    if drafter.fc.weight.device != target.embed.weight.device:
        raise UserError(f"the drafter is on {drafter.fc.weight.device} but the target on "
                        f"{target.embed.weight.device}; move both to one device")
    return block_size


def check_target(config, target, what: str = "drafter"):
    """The target has the dimensions the drafter (DFlash's or EAGLE-3's) was built for; only these: the weights
    may differ, so a drafter trained on a float ar-moe drafts for its FP4 version too."""
    want = {"vocab_size": config.vocab_size, "d_model": config.d_model, "n_layer": config.target_layers,
            "context": config.context}
    for name, value in want.items():
        if getattr(target.config, name) != value:
            raise UserError(f"this {what} was built for a target with {name}={value}, but this target has "
                            f"{getattr(target.config, name)}; pass the target checkpoint it was trained against")


def check_drafter_config(config, rules: dict, what: str, top_layer: int):
    """A drafter config's own fields (`rules`), the target's dimensions, its feature layer ids (0..top_layer)."""
    check_fields(config, {**TARGET_RULES, **rules}, what)
    if not isinstance(config.feature_layers, (list, tuple)):
        raise UserError(f"{what} feature_layers must be a list of layer ids, got {config.feature_layers!r}")
    layer = Rule(integer=True, lo=0, hi=top_layer)
    config.feature_layers = [layer.check(f"{what} feature layer id", i) for i in config.feature_layers]


def check_windows(windows, block_size: int):
    """Training windows hold a block after at least one token of context."""
    if windows.shape[1] < block_size + 1:
        raise UserError(f"windows of {windows.shape[1]} tokens are too short for blocks of {block_size}; "
                        f"use >= {block_size + 1}")
