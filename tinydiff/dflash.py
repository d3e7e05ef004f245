"""DFlash: a block-diffusion drafter that drafts a whole block in one forward pass (model + loss).

Paper: "DFlash: Block Diffusion for Flash Speculative Decoding" (2026); reference code z-lab/dflash.
The drafter is a few Transformer layers of its own around the target's *frozen* embedding and LM
head. It reads the target's hidden states ("context features") and fills a block
`[last committed token, MASK x (B-1)]` in one bidirectional forward: slot k predicts the token at
position start + k. The target then verifies the block in one forward (tinydiff/dflash_decode.py).

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
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinydiff.checks import BLOCK, DEPTH, POSITIVE, SIZE, Rule, check_fields
from tinydiff.drafter import (TARGET_RULES, ExtraKVBlock, check_drafter_config, check_target, init_around,
                              rebuild_around, target_dims)
from tinydiff.errors import UserError
from tinydiff.markov_head import MarkovHead
from tinydiff.model import KVCache, ModelConfig, RMSNorm, Transformer, apply_rope, rope_table, wide
from tinydiff.soft_labels import tempered_ce
from tinydiff.tokenizer import MASK, VOCAB_SIZE

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
    markov_rank: int = 0            # DSpark's Markov head (tinydiff/markov_head.py): its rank r, 0 = none
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


def drafter_from(ckpt: dict, target: Transformer, path="checkpoint") -> DFlashDrafter:
    """Rebuild a drafter from {"config": asdict(DFlashConfig), "model": state_dict} around `target`.
    A config from before `feature_ids` existed read its ids after that many blocks: it keeps reading them so."""
    stored = {**ckpt, "config": {"feature_ids": "after_blocks", **ckpt["config"]}}
    return rebuild_around(target, stored, DFlashConfig, DFlashDrafter, "a DFlash drafter", path)
