"""EAGLE-3: a one-layer draft head that reads the target's features (model + training loss).

Paper: Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test"; reference code SafeAILab/EAGLE. The head is one Transformer block of its own
around the target's *frozen* embedding and LM head. Its row t reads [embedding of token t+1, a
feature of position t] at position t+1 and predicts token t+2 (the EAGLE convention: the feature
says where the text was heading, the token says which way it went):

  step 0    the feature is the target's: its residual streams after a low, a mid and a high block
            (`eagle_layers`), concatenated (3D) and fused by `Linear(3D -> D)`;
  step i>0  past the committed text there is no target feature yet, so the head feeds its own
            output hidden state of step i-1 instead, with the token it drafted there;
  input     `Linear(2D -> D)` on [RMSNorm(embedding), RMSNorm(feature)], then one causal block
            (tinydiff.model's Block over explicit keys/values); committed rows' K/V sit in a KVCache;
  output    the block's output is the next step's feature; through the head's RMSNorm (initialised
            from the target's) it meets the target's tied head, read through `.detach()`.
  training  "training-time test": the head is unrolled K steps on its own features, each step's
            rows attending to exactly the keys the matching draft step sees at inference
            (`unroll_mask`), step i's loss weighted 0.8^i. The loss is cross-entropy against the
            target's own next-token distribution (distillation, as EAGLE-3's reference trains):
            the head learns what the target will say, not what the corpus said. The tokens fed at
            step i are the window's, where inference feeds its drafts: the same whenever the
            earlier drafts were right, the only case in which step i can be accepted.

The target is *held*, not registered (as in tinydiff/dflash.py): a head checkpoint (kind "eagle3")
is the head's weights alone. Decoding is tinydiff/eagle_decode.py. Leaves out: the paper's reduced
draft vocabulary (32k of the target's 128k ids), batched decoding, the data (train on text the
target regenerated: train.py's `--regenerate`), the paper's scale (one Llama layer on an 8B target).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinydiff.checks import DEPTH, MASS, check_fields
from tinydiff.drafter import (TARGET_RULES, ExtraKVBlock, check_drafter_config, check_target, init_around,
                              rebuild_around, target_dims)
from tinydiff.errors import UserError
from tinydiff.model import KVCache, ModelConfig, RMSNorm, Transformer, rope_table
from tinydiff.sampling import next_token_probs
from tinydiff.soft_labels import draftable, soft_ce
from tinydiff.tokenizer import VOCAB_SIZE

KIND = "eagle3"  # the checkpoint kind


def eagle_layers(n_layer: int) -> list[int]:
    """The low, mid and high target layers read (ids as in Transformer.forward(hidden_layers=)).

    EAGLE-3's reference reads after blocks 2, L//2 and L-3 (L = 32: [2, 16, 29]); a target under 8
    blocks has no room for that and reads after blocks 1, (L+1)//2 and L (L = 4: [1, 2, 4]).
    """
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
        check_drafter_config(self, {"steps_ahead": DEPTH, "step_decay": MASS},
                             "EAGLE-3 config")
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
        # Held, not registered: see DFlashDrafter (parameters, state_dict and .to() stay the head's).
        object.__setattr__(self, "target", target)
        self.config = config
        D, H = config.d_model, config.n_head
        if D % H or (D // H) % 2:
            raise UserError(f"d_model {D} must split into {H} heads of even size")
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
        weight = self.target.embed.weight.detach()  # borrowed and frozen
        x = torch.cat([self.embed_norm(F.embedding(tokens, weight)), self.feature_norm(features)], -1)  # (B, T, 2D)
        cos, sin = (c[pos][None, None] for c in (self.rope_cos, self.rope_sin))  # (1, 1, T, D/H/2)
        h, k, v = self.block(self.proj(x), cos, sin, past_k, past_v, mask)  # (B, T, D)
        return F.linear(self.norm(h), weight), h, k, v  # (B, T, V): the target's tied head

    def extend(self, cache: KVCache, tokens, hidden):
        """Append committed rows: tokens (1, T) are the tokens after the positions whose target hidden
        states (3 x (1, T, D)) are given. Returns the last row's logits (V,) and hidden state (D,):
        the first draft of the next round and the feature that goes with it."""
        n, T = cache.length, tokens.shape[1]
        pos = torch.arange(n + 1, n + 1 + T, device=tokens.device)  # row t reads token t+1
        mask = torch.ones(T, n + T, dtype=torch.bool, device=tokens.device).tril(n)  # causal after the cache
        logits, h, k, v = self(tokens, self.fused(hidden), pos, cache.k[0][:, :, :n], cache.v[0][:, :, :n], mask)
        cache.append(0, k, v)
        cache.advance(T)
        return logits[0, -1], h[0, -1]


def unroll_mask(T: int, step: int, device=None):
    """Who row r of unroll step i may attend to: (T, (i+1)T) bool over [step 0 | step 1 | ... | step i].

    Row r at step i is draft step i+1 after the committed row c = r - i: as at inference it sees
    step 0's rows 0..c (the committed rows, read with target features) and from each step m = 1..i
    the single row c + m (the m-th draft row of its own chain; m = i is the row itself). Rows r < i
    have no committed row; they see only themselves and feed no loss.
    """
    r, c = torch.arange(T, device=device)[:, None], torch.arange(T, device=device)[None]
    anchored = r >= step
    return torch.cat([c <= r - step] + [(c == r - step + m) & (anchored | (m == step)) for m in range(1, step + 1)], 1)


def unrolled_logits(head: EagleHead, windows, steps: int):
    """The head unrolled `steps` steps on windows (Bw, T): its logits per step, steps x (Bw, T-1, V)
    (row r predicts token r+2), and the target's logits (Bw, T, V), one frozen target forward."""
    Bw, T = windows.shape
    with torch.no_grad():
        target_logits, hidden = head.target(windows, causal=True, hidden_layers=head.config.feature_layers)
    tokens, pos = windows[:, 1:], torch.arange(1, T, device=windows.device)  # row r reads token r+1
    features = head.fused([h[:, :-1] for h in hidden])  # (Bw, T-1, D): row r's is position r's
    D, H = head.config.d_model, head.config.n_head
    past_k = past_v = features.new_zeros(Bw, H, 0, D // H)
    out = []
    for i in range(steps):
        logits, h, k, v = head(tokens, features, pos, past_k, past_v, unroll_mask(T - 1, i, windows.device))
        past_k, past_v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)  # (Bw, H, (i+1)(T-1), D/H)
        out.append(logits)
        features = F.pad(h[:, :-1], (0, 0, 1, 0))  # row r's next feature: row r-1's hidden (row 0: none)
    return out, target_logits


def eagle_loss(head: EagleHead, windows, generator=None, steps=None, temperature: float = 1.0):
    """Training-time-test distillation loss on windows (Bw, T); returns (loss, stats).

    loss = sum_i w_i CE_i / sum_i w_i, w_i = step_decay^i over steps i = 0..K-1 (K = steps, default
    config.steps_ahead), CE_i the mean over rows r >= i of the cross-entropy of step i's row r
    against the target's distribution for token r+2, both read at `temperature` (soft_labels.py: 1 by
    default, --draft-temperature's for a head trained for sampling there). `generator` is unused (kept for train.py's
    one loss signature). stats: ce (the loss), acc (step 0's argmax == the target's), acc_last
    (the same at step K-1), tau_proxy (1 + the mean run of leading correct steps per committed
    row: the greedy tau at k = K if the target's picks were the data).
    """
    K = head.config.steps_ahead if steps is None else steps
    if not isinstance(K, int) or K < 1:
        raise UserError(f"steps (unrolled draft steps) must be an integer >= 1, got {K!r}")
    T = windows.shape[1]
    if T < K + 1:
        raise UserError(f"windows of {T} tokens are too short to unroll {K} steps; use windows of >= {K + 1}")
    logits, target_logits = unrolled_logits(head, windows, K)
    p = next_token_probs(target_logits[:, 1:], temperature)  # (Bw, T-1, V): the target's for token r+2
    w = [head.config.step_decay ** i for i in range(K)]
    loss = sum(wi * soft_ce(lg[:, i:] / temperature, p[:, i:]).mean() for i, (wi, lg) in enumerate(zip(w, logits)))
    loss = loss / sum(w)
    want = p.argmax(-1)  # (Bw, T-1)
    correct = torch.stack([draftable(lg.detach()).argmax(-1) == want for lg in logits])  # (K, Bw, T-1)
    runs = torch.stack([correct[i, :, i:T - K + i] for i in range(K)]).long()  # (K, Bw, T-K): row c's chain
    last = correct[-1, :, K - 1:].float().mean()  # step K-1's rows that have a committed row
    return loss, {"ce": loss.detach(), "acc": correct[0].float().mean(), "acc_last": last,
                  "tau_proxy": 1 + runs.cumprod(0).sum(0).float().mean()}


def head_from(ckpt: dict, target: Transformer, path="checkpoint") -> EagleHead:
    """Rebuild a head from {"kind": "eagle3", "config": asdict(EagleConfig), "model": state_dict} around `target`."""
    if ckpt.get("kind", KIND) != KIND:
        raise UserError(f"{path} holds a {ckpt['kind']!r} model, not an EAGLE-3 head ({KIND!r})")
    return rebuild_around(target, ckpt, EagleConfig, EagleHead, "an EAGLE-3 head", path)
