"""DFlash: a block-diffusion drafter that drafts a whole block in one forward pass (model + loss).

Paper: "DFlash: Block Diffusion for Flash Speculative Decoding" (2026); reference code z-lab/dflash.
The drafter is a few Transformer layers of its own around the target's *frozen* embedding and LM
head. It reads the target's hidden states ("context features") and fills a block
`[last committed token, MASK x (B-1)]` in one bidirectional forward: slot k predicts the token at
position start + k. The target then verifies the block in one forward (tinydiff/dflash.py).

  features  target residual streams after blocks `feature_layers(L, N)`, concatenated (N*D),
            `Linear(N*D -> D)`, RMSNorm: one vector per committed position;
  layers    each drafter layer applies its own k/v projections to those vectors (RoPE at the
            context positions) and prepends them to the block's keys/values; queries come only
            from the block, which attends to itself bidirectionally and to all of its context;
  input     slot 0 through the target's embedding; the MASK slots get the drafter's own learned
            vector (see DFlashDrafter.__init__ for why not the target's MASK row);
  output    the drafter's own final RMSNorm (initialised from the target's), then the target's
            tied head. Embedding and head are read through `.detach()`: no gradient reaches them.
  cache     per drafter layer, the context K/V of the committed positions only (a model.KVCache);
            the block's K/V are never stored, so nothing needs cropping after a round.
  training  one frozen target forward per window gives the features; up to `anchors` random blocks
            per sequence go through ONE drafter forward with an explicit mask (a block sees context
            strictly before its anchor and itself, nothing else); labels slot k -> token at
            anchor + k, slot 0 unsupervised; CE weights exp(-(k-1)/g).

The target is *held*, not registered as a submodule, so it stays out of the drafter's
parameters(), state_dict() and .to()/.train(): a drafter checkpoint is the drafter alone, and the
target must already sit on the device the drafter is used on (the constructor moves the drafter
there). Leaves out: the paper's scale (5 layers reading 5 features of a 36-layer target), q/k
norms, batched decoding, training on target-regenerated text (train.py's `--regenerate`).

What a drafter built around a frozen target shares (DFlash's block drafter, EAGLE-3's head): the
target's dimensions it copies, the check that a target fits it, its initialisation, its rebuild from
a checkpoint, and its layer: a target-style block whose attention reads keys/values given from
outside (the target's context features, or the head's earlier steps) before its own rows'.

DFlash decoding: one drafter forward drafts a block, one target forward verifies it.

Paper: "DFlash: Block Diffusion for Flash Speculative Decoding" (2026). The drafter is
tinydiff/dflash.py. Each round, with committed sequence seq (S tokens):
  1. draft:  the drafter fills [seq[-1], MASK x (B-1)] at positions S-1..S+B-2 in ONE forward
             (no iterative denoising), reading the context features of positions 0..S-2;
  2. verify: the target reads [seq[-1], d_1..d_K] (K = B-1, fewer at the end) in one forward that
             also returns its hidden states at the feature layers;
  3. accept, by one of two rules (the `rule` argument; RULES pairs each one's draft and judge):
       "match"  (default; DFlash's rule) the drafts are the drafter's argmax; the target samples
                y_0..y_K from its own warped distributions; accept while d_i == y_{i-1}, then commit
                y_n as the bonus. Every committed token is a target sample given its committed
                prefix, so the output is the target's distribution for any draft (with a one-hot
                draft this is exactly the rejection rule: accept x with probability p(x)).
       "reject" the drafts are sampled from the drafter's warped per-slot distributions q_k, then
                speculation's full rule (speculative.verify: accept with min(1, p/q), resample the
                first rejection from the residual). Use it with a sampling draft at T > 0.
     At temperature 0 both rules are plain greedy decoding of the target, token for token.
  4. commit: crop the target cache to the committed length and append the features of the newly
     committed positions to the drafter's context cache.
Caches: after every round both hold exactly the committed tokens but the newest (seq[:-1]); the
newest is slot 0 of the next block. Before the first round a prefill forward of the target over
prompt[:-1] fills both (skipped for a one-token prompt): target_forwards = rounds + that prefill.

A drafter with DSpark's Markov head (tinydiff/extras/markov_head.py) drafts the same one forward, then
picks its slots left to right through the head: argmax, or sampled for "reject".
DSpark's confidence-scheduled verify length (`min_confidence`): the target verifies only the drafts
before the first slot the drafter itself gives under that probability (at least one). A shorter
verify is still the rule above on fewer drafts, so it stays lossless; DSpark predicts acceptance
with a trained confidence head, here the drafter's own probability of its draft stands in for it.
Leaves out: batches, draft trees (see ddtree.py), iterative refinement of the block.
"""
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinydiff.ar import check_prompt, split_time
from tinydiff.checks import BLOCK, DEPTH, POSITIVE, PROBABILITY, SIZE, Rule, UserError, check_fields
from tinydiff.extras.markov_head import MarkovHead, draft_left_to_right
from tinydiff.model import RULES, Block, KVCache, ModelConfig, RMSNorm, Transformer, apply_rope, rope_table, wide
from tinydiff.sampling import check_warp_args, next_token_probs, sample, tempered_ce
from tinydiff.speculative import Tally, cut_at_stop, verify
from tinydiff.tokenizer import EOT, MASK, VOCAB_SIZE

RANK = Rule(integer=True, lo=0, hi=4096)  # a Markov head's rank, 0 = none
PUBLISHED_DECAY = {8: 4.0, 10: 5.0, 16: 7.0}  # block size B -> loss decay g (the paper's choices)
FEATURE_IDS = ("block_output", "after_blocks")


def feature_layers(n_layer: int, n: int) -> list[int]:
    """Target layer ids to read: N evenly spaced from 1 to L-3 (rounded); N = 1 gives [L // 2].

    Id i is the output of 0-indexed target block i, the paper's meaning (Hugging Face's
    hidden_states[i + 1]; `DFlashConfig.taps` turns ids into `Transformer.forward(hidden_layers=)`'s).
    L = 36, N = 5 -> [1, 9, 17, 25, 33]; L = 8, N = 2 -> [1, 5].
    """
    if n_layer < 1 or n < 1:
        raise UserError(f"need a target of >= 1 layer and >= 1 feature layer, got L={n_layer}, N={n}")
    if n == 1:
        return [n_layer // 2]
    if n > n_layer - 3:
        raise UserError(f"a {n_layer}-layer target has {max(0, n_layer - 3)} layers in 1..L-3 to read; "
                        f"use n_features <= {max(1, n_layer - 3)}")
    span = n_layer - 4  # from layer 1 to layer L-3
    return [round(1 + i * span / (n - 1)) for i in range(n)]


def default_decay(block_size: int) -> float:
    """The paper's g for B = 8, 10, 16; otherwise linear through the nearest two of them, at least 1."""
    if block_size in PUBLISHED_DECAY:
        return PUBLISHED_DECAY[block_size]
    points = sorted(PUBLISHED_DECAY.items())
    (b0, g0), (b1, g1) = points[:2] if block_size < 10 else points[1:]
    return max(1.0, g0 + (block_size - b0) * (g1 - g0) / (b1 - b0))


@dataclass
class DFlashConfig:
    n_layer: int = 1                # drafter Transformer layers (1-2 at our scale)
    block_size: int = 16            # B: slot 0 = last committed token, slots 1..B-1 = MASK to fill
    n_features: int = 5             # N: target layers read (capped at L-3, or 1); the paper uses 5
    feature_layers: list | None = None  # their ids; None: feature_layers(L, N)
    feature_ids: str = "block_output"   # what id i means: the output of block i (0-indexed, the paper's),
    #                                     or "after_blocks": after i blocks, 0 = the embeddings (what
    #                                     drafters saved before this field meant; they keep that meaning)
    loss_decay: float | None = None  # g in exp(-(k-1)/g); None: 7 for B=16, 5 for 10, 4 for 8, else interpolated
    anchors: int = 32               # training: most random blocks per sequence (at most T - B)
    markov_rank: int = 0            # DSpark's Markov head (tinydiff/extras/markov_head.py): its rank r, 0 = none
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
        check_fields(self, {**TARGET_RULES, "n_layer": DEPTH, "n_features": SIZE},
                     "DFlash config")
        if self.feature_layers is None:
            self.feature_layers = feature_layers(self.target_layers, self.n_features)
        if self.loss_decay is None:
            self.loss_decay = default_decay(self.block_size)
        if self.feature_ids not in FEATURE_IDS:
            raise UserError(f"DFlash config feature_ids must be one of {', '.join(FEATURE_IDS)}, "
                            f"got {self.feature_ids!r}")
        top = self.target_layers - (self.feature_ids == "block_output")  # the last block's output, or after it
        check_drafter_config(self, {"block_size": BLOCK, "anchors": SIZE, "loss_decay": POSITIVE, "markov_rank": RANK},
                             "DFlash config", top)
        self.n_features = len(self.feature_layers)

    @property
    def taps(self) -> list[int]:
        """The feature layers as `Transformer.forward(hidden_layers=)` counts them (after i blocks)."""
        return [i + 1 for i in self.feature_layers] if self.feature_ids == "block_output" else list(self.feature_layers)

    @classmethod
    def for_target(cls, target_config: ModelConfig, **overrides) -> "DFlashConfig":
        """A config that copies the target's dimensions; N defaults to min(5, L-3) (at least 1)."""
        dims = {**target_dims(target_config), "n_features": max(1, min(5, target_config.n_layer - 3))}
        return cls(**{**dims, **overrides})


class DFlashDrafter(nn.Module):
    def __init__(self, config: DFlashConfig, target: Transformer):
        super().__init__()
        check_target(config, target)
        # Held, not registered: a registered submodule would put the target's weights into our
        # parameters() (the optimizer), state_dict() (the checkpoint) and .train()/.to().
        object.__setattr__(self, "target", target)
        self.config = config
        D, H = config.d_model, config.n_head
        self.layer_config = ModelConfig(vocab_size=config.vocab_size, context=config.context,
                                        n_layer=config.n_layer, n_head=H, d_model=D, d_ff=config.d_ff,
                                        causal=False, rope_base=config.rope_base, norm_eps=config.norm_eps)
        if D % H or (D // H) % 2:
            raise UserError(f"d_model {D} must split into {H} heads of even size")
        self.fc = nn.Linear(config.n_features * D, D, bias=False)  # N*D -> D
        self.feature_norm = RMSNorm(D, config.norm_eps)
        self.layers = nn.ModuleList(ExtraKVBlock(self.layer_config) for _ in range(config.n_layer))
        self.norm = RMSNorm(D, config.norm_eps)
        # The MASK slots' input: a vector of our own, not the target's MASK row. An AR target with a
        # tied head trains that row only as an output that must never win, which makes it a poor
        # input (docs/LOG.md, "DFlash's MASK input"). It also lets MASK = 50257 mark the slots in any
        # vocabulary, even V = 6.
        self.mask_embed = nn.Parameter(torch.zeros(D))
        # Blocks near the end of the context reach past it (their drafts are cut, not their input).
        cos, sin = rope_table(config.context + config.block_size, D // H, config.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.markov = MarkovHead(config.vocab_size, config.markov_rank) if config.markov_rank else None
        init_around(self, target, config.n_layer)
        if self.markov is not None:
            self.markov.zero_()  # a new head starts as plain DFlash

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
            k, v = (w(ctx).view(B, T, layer.attn.n_head, -1).transpose(1, 2) for w in (layer.attn.wk, layer.attn.wv))
            out.append((apply_rope(k, cos, sin), v))
        return out

    def extend(self, cache: KVCache, hidden):
        """Append the features of the next committed positions (hidden: N x (B, T, D)) to the cache."""
        start, T = cache.length, hidden[0].shape[1]
        kv = self.context_kv(self.features(hidden), torch.arange(start, start + T, device=cache.k[0].device))
        for i, (k, v) in enumerate(kv):
            cache.append(i, k, v)
        cache.advance(T)

    def forward(self, block, pos, ctx_k, ctx_v, mask=None):
        """Logits (B, T, V) for block ids (B, T) at positions pos (T,) or (B, T).

        ctx_k, ctx_v: per layer (B, H, S, D/H) context keys/values; mask: bool (B, 1, T, S + T),
        True = may attend, or None (everything visible: inference, one block after its context).
        """
        weight = self.target.embed.weight.detach()  # borrowed and frozen
        is_mask = block == MASK  # (B, T)
        x = F.embedding(block.masked_fill(is_mask, 0), weight)  # (B, T, D); MASK may lie outside V
        x = torch.where(is_mask[..., None], self.mask_embed.to(x.dtype), x)
        cos, sin = self.rope(pos)
        for i, layer in enumerate(self.layers):
            x, _, _ = layer(x, cos, sin, ctx_k[i], ctx_v[i], mask)  # the context's keys first
        return F.linear(self.norm(x), weight)  # (B, T, V): the target's tied head


def block_input(last_token: int, block_size: int, device=None):
    """The block the drafter fills: [last committed token, MASK x (B-1)], shape (1, B)."""
    block = torch.full((1, block_size), MASK, dtype=torch.long, device=device)
    block[0, 0] = int(last_token)
    return block


def draft_block(drafter: DFlashDrafter, cache: KVCache, last_token: int, hidden=None, block_size=None):
    """Draft logits (B-1, V) for slots 1..B-1: the block starts right after the cached context.

    hidden (N x (1, T, D) target features of the newest committed positions), if given, is first
    appended to the cache. Slot 0 is the newest committed token, at position cache.length.
    """
    if hidden is not None:
        drafter.extend(cache, hidden)
    B = block_size or drafter.config.block_size
    n = cache.length
    block = block_input(last_token, B, cache.k[0].device)
    pos = torch.arange(n, n + B, device=block.device)
    ctx_k, ctx_v, mask = cache.past(B)
    return drafter(block, pos, ctx_k, ctx_v, mask)[0, 1:]


def training_mask(anchors, block_size: int, T: int):
    """Who may attend to whom in the packed forward: (Bw, A*B, T + A*B) bool for anchors (Bw, A).

    Columns: T context positions, then the A blocks of B slots. A block's rows see context columns
    strictly before its anchor and the columns of its own block, nothing else.
    """
    A = anchors.shape[1]
    row_anchor = anchors.repeat_interleave(block_size, 1)  # (Bw, A*B)
    sees_context = torch.arange(T, device=anchors.device) < row_anchor[..., None]  # (Bw, A*B, T)
    blocks = torch.arange(A * block_size, device=anchors.device) // block_size
    sees_block = (blocks[:, None] == blocks[None, :]).expand(len(anchors), -1, -1)  # (Bw, A*B, A*B)
    return torch.cat([sees_context, sees_block], -1)


def packed_logits(drafter: DFlashDrafter, windows, anchors):
    """Draft logits (Bw, A, B-1, V) for the blocks at anchors (Bw, A) of windows (Bw, T), and the
    target's logits (Bw, T, V): one target forward (frozen, no gradient) for the features, ONE
    drafter forward for all the blocks."""
    cfg, (Bw, T), A = drafter.config, windows.shape, anchors.shape[1]
    B = cfg.block_size
    with torch.no_grad():
        target_logits, hidden = drafter.target(windows, causal=True, hidden_layers=cfg.taps)
    kv = drafter.context_kv(drafter.features(hidden), torch.arange(T, device=windows.device))
    pos = (anchors[..., None] + torch.arange(B, device=windows.device)).flatten(1)  # (Bw, A*B)
    block = windows.gather(1, pos).view(Bw, A, B)
    block[:, :, 1:] = MASK  # [token at anchor, MASK x (B-1)] per block
    mask = training_mask(anchors, B, T)[:, None]  # (Bw, 1, A*B, T + A*B): shared by heads
    logits = drafter(block.flatten(1), pos, [k for k, _ in kv], [v for _, v in kv], mask)  # (Bw, A*B, V)
    return logits.view(Bw, A, B, -1)[:, :, 1:], target_logits


def sample_anchors(batch: int, T: int, block_size: int, anchors: int, generator=None, device=None):
    """min(anchors, T - B) distinct random anchors per sequence in [1, T - B]: (batch, A), unsorted.

    From 1: every block has context; up to T - B: its last slot's label is still in the window.
    """
    A = min(anchors, T - block_size)
    return torch.rand(batch, T - block_size, generator=generator, device=device).argsort(-1)[:, :A] + 1


def dflash_loss(drafter: DFlashDrafter, windows, generator=None, temperature: float | None = None):
    """Weighted block CE on windows (Bw, T) of clean text; returns (loss, stats).

    Anchors: `sample_anchors` (config.anchors per sequence, at most T - B). Slot k (1..B-1) is
    weighted exp(-(k-1)/g) and the loss is the weighted mean sum(w_k CE_k) / sum(w_k), averaged over
    blocks, so it reads as nats per token whatever B is. The MASK logit is left out, as at inference.
    With a Markov head, slot k's logits carry its bias from the text's token at k - 1.
    CE_k is against the text's token (hard labels), or with a `temperature` against the target's
    distribution at that position read at it (soft_labels.tempered_ce: a drafter trained for sampling).
    stats: ce (that loss), acc (slot-1 argmax == label), tau_proxy (1 + the mean run of leading
    correct slots: the greedy tau if the target's picks were the data).
    """
    cfg, (Bw, T) = drafter.config, windows.shape
    B = cfg.block_size
    if T < B + 1:
        raise UserError(f"windows of {T} tokens are too short for blocks of {B}; use windows of >= {B + 1}")
    anchors = sample_anchors(Bw, T, B, cfg.anchors, generator, windows.device)  # (Bw, A)
    A = anchors.shape[1]
    logits, target_logits = packed_logits(drafter, windows, anchors)  # (Bw, A, B-1, V), (Bw, T, V)
    positions = (anchors[..., None] + torch.arange(1, B, device=windows.device)).flatten(1)  # (Bw, A*(B-1))
    labels = windows.gather(1, positions).view(Bw, A, B - 1)
    if drafter.markov is not None:  # slot k's bias from the text's token at k-1 (teacher forcing)
        logits = logits + drafter.markov(windows.gather(1, positions - 1).view(Bw, A, B - 1)).to(logits.dtype)
    if logits.shape[-1] > MASK:  # never a label, never drafted (next_token_probs): keep no mass on it
        logits[..., MASK] = float("-inf")
    if temperature is None:
        ce = F.cross_entropy(logits.flatten(0, 2).to(wide(logits.dtype)), labels.flatten(), reduction="none")
    else:  # the target's distribution for slot k's position, predicted from the position before it
        V = target_logits.shape[-1]
        predicted = target_logits.gather(1, (positions - 1)[..., None].expand(-1, -1, V))  # (Bw, A*(B-1), V)
        ce = tempered_ce(logits, predicted.view(Bw, A, B - 1, V), temperature)
    ce = ce.view(Bw, A, B - 1)
    slots = torch.arange(B - 1, device=windows.device, dtype=ce.dtype)
    w = torch.exp(-slots / cfg.loss_decay)  # slot k: exp(-(k-1)/g)
    loss = (ce * w).sum(-1).mean() / w.sum()
    correct = (logits.argmax(-1) == labels).long()  # (Bw, A, B-1)
    return loss, {"ce": loss.detach(), "acc": correct[..., 0].float().mean(),
                  "tau_proxy": 1 + correct.cumprod(-1).sum(-1).float().mean()}


# The target's dimensions a drafter's config copies, checked as the target's own config is.
TARGET_RULES = {**{key: RULES[key] for key in ("vocab_size", "context", "d_model", "n_head", "d_ff", "rope_base",
                                               "norm_eps")}, "target_layers": RULES["n_layer"]}


def check_drafter_config(config, rules: dict, what: str, top_layer: int | None = None):
    """A drafter config's own fields (`rules`), the target's dimensions, and its feature layer ids
    (0..top_layer, default 0..the target's layer count)."""
    check_fields(config, {**TARGET_RULES, **rules}, what)
    if not isinstance(config.feature_layers, (list, tuple)):
        raise UserError(f"{what} feature_layers must be a list of layer ids, got {config.feature_layers!r}")
    layer = Rule(integer=True, lo=0, hi=config.target_layers if top_layer is None else top_layer)
    config.feature_layers = [layer.check(f"{what} feature layer id", i) for i in config.feature_layers]


def target_dims(t: ModelConfig) -> dict:
    """The target dimensions a drafter built around it copies (DFlash here, EAGLE-3 too)."""
    return dict(vocab_size=t.vocab_size, context=t.context, d_model=t.d_model, target_layers=t.n_layer,
                n_head=t.n_head, d_ff=t.d_ff, rope_base=t.rope_base, norm_eps=t.norm_eps)


def check_target(config, target, what: str = "drafter"):
    """The target must have the dimensions the drafter (a DFlash or EAGLE-3 config) was built for: its
    width, vocabulary and context, and the layer count its feature ids refer to. Only these: the
    weights may differ, so a drafter trained on a float ar-moe drafts for its FP4 version too."""
    t = target.config
    want = {"vocab_size": config.vocab_size, "d_model": config.d_model, "n_layer": config.target_layers,
            "context": config.context}
    for name, value in want.items():
        if getattr(t, name) != value:
            raise UserError(f"this {what} was built for a target with {name}={value}, but this target has "
                            f"{getattr(t, name)}; pass the target checkpoint the {what} was trained against")


def init_around(drafter: nn.Module, target: Transformer, n_layer: int):
    """A drafter's own weights initialised as the target's were (residual outputs scaled down by
    sqrt(2 n_layer)), its final norm copied from the target's, and the drafter moved to its device.
    Shared by the drafters built around a target (DFlash, EAGLE-3)."""
    drafter.apply(Transformer._init_weights)
    for name, p in drafter.named_parameters():
        if name.endswith(("wo.weight", "down.weight")):
            nn.init.normal_(p, std=0.02 / (2 * n_layer) ** 0.5)
    with torch.no_grad():
        drafter.norm.weight.copy_(target.norm.weight)
    drafter.to(target.embed.weight.device)


class ExtraKVBlock(Block):
    """tinydiff.model's Block (the same modules, the same projections) whose attention reads
    [past keys; its own rows' keys]; it returns its rows' keys/values too, which are never written
    into a KVCache (a drafter's rows are drafts until the target verifies them)."""

    def forward(self, x, cos, sin, past_k, past_v, mask):
        B, T, D = x.shape
        q, k, v = self.attn.project(self.attn_norm(x), cos, sin)  # (B, H, T, D/H), RoPE applied
        keys, values = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)  # (B, H, S + T, D/H): the past first
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # no mask: every key is visible
        x = x + self.attn.wo(y.transpose(1, 2).reshape(B, T, D))
        return x + self.ffn(self.ffn_norm(x)), k, v


def sample_and_match(p, drafts, generator=None, greedy=False):
    """p (K+1, V) the target's warped distributions, drafts (K,) -> (n, token).

    The target draws y_i ~ p_i position by position; drafts are accepted while drafts[i] == y_i;
    `token` = y_n, the target's own sample after the accepted prefix. Draws stop at the first
    mismatch (later ones would be thrown away). greedy: p is one-hot, so its sample is its argmax.
    """
    if greedy:
        return greedy_match(p, drafts)
    for i in range(len(drafts) + 1):
        y = int(sample(p[i], generator))
        if i == len(drafts) or y != int(drafts[i]):
            return i, y


def greedy_match(p, drafts):
    """sample_and_match at temperature 0, every position at once: the target's argmax at each, the
    drafts kept up to the first that differs. One read-back of the GPU, not two per position."""
    y = p.argmax(-1)  # (K+1,)
    kept = (y[:-1] == drafts).cumprod(0).sum()  # () drafts before the first mismatch
    n, token = torch.stack([kept, y[kept]]).tolist()
    return n, token


def argmax_drafts(logits, warp_args, generator=None, markov=None, first_token=None):
    """The "match" rule's drafts (K,): the drafter's argmax per slot (never MASK); no q is needed.
    With a Markov head, the argmax chain of the biased logits, left to right from first_token.
    Returns (drafts, q = None, the rows (K, V) the drafts were picked from)."""
    if markov is not None:
        drafts, rows = draft_left_to_right(markov, logits, first_token, lambda row: argmax_drafts(row, warp_args)[0])
        return drafts, None, rows
    return next_token_probs(logits, 0, None, None).argmax(-1), None, logits


def sampled_drafts(logits, warp_args, generator=None, markov=None, first_token=None):
    """The "reject" rule's drafts (K,), sampled from q (K, V), the slots warped exactly like the target
    (one-hot q at T = 0), and q itself, which the rejection rule needs. With a Markov head each slot
    is sampled from its row biased by the draft before it, and q holds those rows' distributions.
    Returns (drafts, q, the rows (K, V) the drafts were drawn from)."""
    if markov is not None:
        drafts, rows = draft_left_to_right(markov, logits, first_token,
                                           lambda row: sampled_drafts(row, warp_args, generator)[0])
        return drafts, next_token_probs(rows, *warp_args), rows
    q = next_token_probs(logits, *warp_args)
    return (sample(q, generator) if warp_args[0] > 0 else q.argmax(-1)), q, logits


def confident_prefix(rows, drafts, min_confidence: float) -> int:
    """DSpark's verify length: how many drafts come before the first slot whose predicted acceptance,
    the drafter's own unwarped probability of its draft, is under min_confidence. At least one: the
    drafter forward is paid already, and a verify of two tokens costs about what one costs."""
    confidence = next_token_probs(rows.to(wide(rows.dtype)), 1.0).gather(-1, drafts[:, None])[:, 0]  # (K,)
    low = (confidence < min_confidence).nonzero()
    return max(1, int(low[0])) if len(low) else len(drafts)


def match(p, drafts, q, generator=None, greedy=False):
    """DFlash's rule: the target samples each position, a draft is kept while it equals the sample."""
    return sample_and_match(p, drafts, generator, greedy)


def reject(p, drafts, q, generator=None, greedy=False):
    """Speculation's rule (speculative.verify) for sampled drafts; a round without drafts commits the
    target's one sample."""
    return verify(p, q, drafts, generator) if len(drafts) else sample_and_match(p, drafts, generator, greedy)


RULES = {"match": (argmax_drafts, match), "reject": (sampled_drafts, reject)}  # rule -> (draft, judge)


def check_drafter(target, drafter, block_size) -> int:
    """The drafter must be a DFlashDrafter built for this target's dimensions; returns the block size."""
    if not isinstance(drafter, DFlashDrafter):
        raise UserError(f"the drafter is a {type(drafter).__name__}; build one with tinydiff.dflash.DFlashDrafter "
                        "or load a DFlash drafter checkpoint")
    check_target(drafter.config, target)
    block_size = drafter.config.block_size if block_size is None else block_size
    if not isinstance(block_size, int) or not 2 <= block_size <= drafter.config.block_size:
        raise UserError(f"block size must be an integer in [2, {drafter.config.block_size}] for this drafter "
                        f"(trained with blocks of {drafter.config.block_size}), got {block_size!r}")
    if drafter.fc.weight.device != target.embed.weight.device:
        raise UserError(f"the drafter is on {drafter.fc.weight.device} but the target on "
                        f"{target.embed.weight.device}; move both to one device")
    return block_size


def prefill_caches(target, drafter, prompt, target_cache, draft_cache) -> int:
    """Read all but the prompt's newest token into the target's cache and their features into the
    drafter's context cache; returns the target forwards spent (0 for a one-token prompt)."""
    if len(prompt) < 2:
        return 0
    x = torch.tensor([prompt[:-1]], device=target.embed.weight.device)
    _, hidden = target(x, cache=target_cache, causal=True, hidden_layers=drafter.config.taps)
    drafter.extend(draft_cache, hidden)
    return 1


def start_decoding(target, drafter, prompt, max_new_tokens, block_size, warp_args):
    """What every loop of a block drafter (DFlash, DDTree, their fused rounds) checks and does before its
    first round: the warp, the prompt (MASK would read as a MASK slot: the drafter embeds MASK with its
    own vector), the drafter and block size; then both caches, and the prefill. Returns (new tokens to
    decode, B, target_cache, draft_cache, prefill forwards)."""
    check_warp_args(*warp_args)
    n_new = check_prompt(prompt, target.config.context, max_new_tokens)
    if MASK in prompt:
        raise UserError(f"the prompt holds the MASK id {MASK}; pass text (MASK is only for diffusion canvases)")
    B = check_drafter(target, drafter, block_size)
    target_cache, draft_cache = target.new_cache(1), drafter.new_cache(1)
    return n_new, B, target_cache, draft_cache, prefill_caches(target, drafter, prompt, target_cache, draft_cache)


def draft_and_verify(target, drafter, target_cache, draft_cache, seq, n_drafts, B, rule, warp_args, generator=None,
                     min_confidence=None, tally=None):
    """One round's drafting and verifying after seq: ONE drafter forward for the block (none when n_drafts
    is 0), ONE target forward for [seq[-1], drafts], the rule's judgement. The target's cache then holds
    the verified rows, the drafter's is unchanged (`commit` settles both). tally, if given, clocks the
    stages. Returns (drafts (K,), n accepted, the committed token, the verify's hidden states N x (1, K+1, D))."""
    draw, judge = RULES[rule]
    device = target.embed.weight.device
    drafts, q = torch.empty(0, dtype=torch.long, device=device), None
    t0 = time.perf_counter()
    if n_drafts:  # draft: ONE drafter forward for the block
        logits = draft_block(drafter, draft_cache, seq[-1], block_size=B)[:n_drafts]  # (K, V)
        drafts, q, rows = draw(logits, warp_args, generator, drafter.markov, seq[-1])
        if min_confidence is not None:  # verify only the drafts the drafter is sure enough of
            m = confident_prefix(rows, drafts, min_confidence)
            drafts, q = drafts[:m], None if q is None else q[:m]
    t1 = split_time(device)
    x = torch.cat([torch.tensor([seq[-1]], device=device), drafts])[None]  # (1, K+1)
    # verify: ONE forward, which also returns the features of the inputs it reads
    logits, hidden = target(x, cache=target_cache, causal=True, hidden_layers=drafter.config.taps)
    n, token = judge(next_token_probs(logits[0], *warp_args), drafts, q, generator, warp_args[0] == 0)
    if tally is not None:
        tally.clock(t0, t1, time.perf_counter())  # judge's int() waited for the GPU
    return drafts, n, token, hidden


def commit(seq, out, tokens, stop_token, target_cache, drafter, draft_cache, hidden=None):
    """The round's tokens (the accepted drafts, then the target's token) cut after stop_token, appended to
    seq and out; both caches left holding seq[:-1]: the target's cropped (its rejected rows dropped), the
    drafter's context extended with the features (hidden) of the inputs now committed, or, where a
    fused round wrote every verified row already (hidden None), cropped as well. Returns (tokens, stopped)."""
    tokens, stopped = cut_at_stop(tokens, stop_token)
    seq += tokens
    out += tokens
    target_cache.crop(len(seq) - 1)  # the newest token is read next round
    if hidden is None:
        draft_cache.crop(len(seq) - 1)
    else:
        drafter.extend(draft_cache, [h[:, :len(tokens)] for h in hidden])
    return tokens, stopped


@torch.no_grad()
def dflash_generate(target, drafter, prompt, max_new_tokens, block_size=None, temperature=0.0, top_k=None,
                    top_p=None, generator=None, stop_token=EOT, on_round=None, rule="match",
                    min_confidence=None):
    """Decode after `prompt` (list of ids); each round drafts a block of block_size (default the
    drafter's B) and commits 1..B tokens. Stops after max_new_tokens (None: fill the context) or
    after emitting stop_token (None: never; tokens after it in the same round are dropped).
    on_round(info) is called after every round with: drafts, accepted (n), tokens (committed this
    round), seq (prompt + everything committed), target_cache, draft_cache (both rolled back).
    min_confidence (None: verify every draft): DSpark's confidence-scheduled verify length.

    Returns (new ids, tally.Speculated): accepted over n = 0..B-1, forwards = rounds + the prefill,
    one draft forward per round that drafted.
    """
    if rule not in RULES:
        raise UserError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    if min_confidence is not None:
        PROBABILITY.check("min_confidence", min_confidence)
    warp_args, device = (temperature, top_k, top_p), target.embed.weight.device
    n_new, B, target_cache, draft_cache, prefill = start_decoding(target, drafter, prompt, max_new_tokens, block_size,
                                                                  warp_args)
    seq, out = list(prompt), []
    tally = Tally(B - 1)
    tally.prefill = prefill
    while len(out) < n_new:
        n_drafts = min(B - 1, n_new - len(out) - 1)  # a full acceptance plus the bonus lands on n_new
        drafts, n, token, hidden = draft_and_verify(target, drafter, target_cache, draft_cache, seq, n_drafts, B, rule,
                                                    warp_args, generator, min_confidence, tally)
        tokens, stopped = commit(seq, out, drafts.tolist()[:n] + [token], stop_token, target_cache, drafter,
                                 draft_cache, hidden)
        tally.add(n, len(drafts), int(n_drafts > 0))  # one drafter forward per round that drafted
        if on_round is not None:
            on_round({"drafts": drafts.tolist(), "accepted": n, "tokens": tokens, "seq": list(seq),
                      "target_cache": target_cache, "draft_cache": draft_cache})
        if stopped:
            break
    return out, tally.result(out, device)
