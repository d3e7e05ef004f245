"""What a drafter built around a frozen target shares (DFlash's block drafter, EAGLE-3's head): the
target's dimensions it copies, the check that a target fits it, its initialisation, its rebuild from
a checkpoint, and its layer: a target-style block whose attention reads keys/values given from
outside (the target's context features, or the head's earlier steps) before its own rows'.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from tinydiff.checkpoint import brief_error
from tinydiff.checks import Rule, check_fields
from tinydiff.errors import UserError
from tinydiff.model import RULES, Block, ModelConfig, Transformer


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


def rebuild_around(target, ckpt: dict, config_class, drafter_class, what: str, path):
    """A drafter built around `target` (DFlash, EAGLE-3) from its checkpoint's config and weights."""
    try:
        config = config_class(**ckpt["config"])
    except TypeError as e:
        raise UserError(f"{path}: not {what} config ({e})") from None
    drafter = drafter_class(config, target)
    try:
        drafter.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise UserError(f"{path}: weights do not fit {what}'s config ({brief_error(e)})") from None
    return drafter.eval()
