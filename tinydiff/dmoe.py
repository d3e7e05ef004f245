"""dMoE: a mixture-of-experts LM (diffusion, or causal: tinydiff/extras/ar_moe.py), token and block routing.

Token routing (the standard top-k MoE: Shazeer et al. 2017, Switch Transformer, Mixtral): a
router `Linear(D -> E)` scores every token, the token goes to its top-k experts, and their
outputs are mixed with the top-k scores renormalised to sum to 1. Every expert is a SwiGLU
(`tinydiff.model.FeedForward`); an optional shared expert sees every token. Switch's
load-balancing term E * sum_i f_i * P_i (f_i: share of routing slots that went to expert i, P_i:
the mean router probability of expert i) is stored on the layer after each forward: it is 1 when
routing is perfectly balanced (f_i = P_i = 1/E) and E when everything collapses onto one expert.

Block routing (dMoE, after "LLaDA2.0-mini": diffusion LMs decode a block of tokens per forward, so
token routing reads the weights of nearly every expert): per token keep its own top-k scores
(others 0), sum them over each block of `route_block` consecutive positions and normalise; the
block's coreset is the smallest set of experts, taken in descending order, whose mass reaches
`route_threshold` (always the first one and the one that crosses it); if that is smaller than
`route_guard`, the top-guard experts instead. Every token then takes its top-k inside its block's
coreset. Published (256 experts, top-8, block 32): unique experts per block forward 69.5 -> 14.6
with 99.1% of the quality kept, after fine-tuning with block routing on.

The mask vote (ours, not the paper's; `route_mask_vote`, 1 = the paper's rule): a MASK token's
top-k scores count w times a committed token's in its block's mass. Of a block forward's outputs
the sampler reads only the MASK positions' (committed tokens reach them only through attention),
yet after the first few steps committed tokens are most of the block and, voting alike, pick the
coreset. A block without MASK tokens (a finished block on its way into the KV cache) routes as before.

Scores are softmax probabilities: each token casts one vote of total weight 1 into its block's
distribution, and the Switch term is defined on them.
Dispatch is a plain loop over experts (index_select the routed tokens, run the expert, index_add
the weighted result): an expert no token chose is never read. Without gradients, where Triton
runs (kernels/__init__.py), one grouped-GEMM launch does the same (kernels/moe_ffn.py). A layer keeps
its latest routing in `last`; `unique_experts` counts what a block read (the measuring tools count
bytes and time: tinydiff/bench/moe_stats.py).

Routing blocks are counted back from the end of the sequence the model is given. The samplers'
canvases (tinydiff/sampler.py) end on a block boundary, so every routing block is one decoding
block, cached or not; what is left of the prompt forms the first, shorter block. A causal model
(ar-moe) routes by token only: its KV cache sees each token once, never the block around it.

FP4 experts (MoEConfig.expert_format mxfp4 / nvfp4): tinydiff/fp4.py's layer holds them packed and
overrides `routed`; quantization-aware training (tinydiff/extras/qat.py) swaps in fake-quantized experts.
Leaves out: sigmoid router scores (DeepSeek-V3), capacity factors and token dropping, expert
parallelism, aux-loss-free bias balancing, a grouped-GEMM backward pass.
"""
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from tinydiff import kernels
from tinydiff.checks import MASS, POSITIVE, SIZE, WEIGHT, Rule, UserError, check_fields
from tinydiff.diffusion import diffusion_loss
from tinydiff.model import PRESETS, FeedForward, ModelConfig, Transformer, gpt2_init_, wide
from tinydiff.tokenizer import MASK

ROUTINGS = ("token", "block")
CAUSAL_ROUTING = "block routing is for diffusion LMs (mdlm-moe); a causal MoE (ar-moe) routes by token"
EXPERT_FORMATS = ("float", "mxfp4", "nvfp4")  # packed FP4 experts: tinydiff/fp4.py


@dataclass
class MoEConfig(ModelConfig):
    n_experts: int = 32            # routed experts per layer (E)
    moe_top_k: int = 3             # experts each token is routed to (k)
    expert_d_ff: int | None = None  # expert SwiGLU width; None = d_ff // (k + shared): active FFN = dense FFN
    shared_expert: bool = True     # one more expert that every token passes through
    balance_coef: float = 0.01     # weight of the summed Switch load-balancing terms in the loss
    routing: str = "token"         # "token" (top-k per token) or "block" (top-k inside the block's coreset)
    route_block: int = 32          # positions per routing block (also the block of the stats)
    route_threshold: float = 0.6   # block routing: coreset mass to reach
    route_guard: int = 4           # block routing: coreset size at least this (>= moe_top_k)
    route_mask_vote: float = 1.0   # block routing: a MASK token's vote, against a committed token's 1
    expert_format: str = "float"   # the experts' weights: "float", or packed FP4 ("mxfp4", "nvfp4": tinydiff/fp4.py)
    expert_block: int = 32         # FP4 experts: values per scale along each expert's input (32: OCP MX)

    def __post_init__(self):
        super().__post_init__()
        check_fields(self, MOE_RULES, "model config")
        if self.expert_d_ff is None:
            self.expert_d_ff = max(1, self.d_ff // (self.moe_top_k + int(self.shared_expert)))
        SIZE.check("model config expert_d_ff", self.expert_d_ff)
        check_routing(self.routing, self.route_guard, self.moe_top_k, self.n_experts)
        if self.expert_format not in EXPERT_FORMATS:  # a packed format's blocks are checked by fp4.moe_model
            raise UserError(f"expert_format must be one of {', '.join(EXPERT_FORMATS)}, got {self.expert_format!r}")


def moe_config(name: str, **overrides) -> MoEConfig:
    """A MoE variant of preset `name` (bidirectional unless causal=True) with the dense model's active FFN size."""
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return MoEConfig(**{**PRESETS[name].__dict__, "causal": False, **overrides})


def pad_blocks(x, block_size: int):
    """(B, T, ...) -> (B, n_blocks, block_size, ...), blocks counted back from the end: the first one
    is padded in front with zeros (False) when T is not a multiple of block_size."""
    B, T = x.shape[:2]
    n_blocks = -(-T // block_size)
    pad = x.new_zeros(B, n_blocks * block_size - T, *x.shape[2:])
    return torch.cat([pad, x], 1).view(B, n_blocks, block_size, *x.shape[2:])


def block_mass(scores, top_k: int, block_size: int, votes=None):
    """Each block's routing distribution (B, n_blocks, E): its tokens' top-k scores, summed (each
    token's weighted by its vote (B, T) when given), normalised."""
    top = scores.topk(top_k, dim=-1)
    kept = torch.zeros_like(scores).scatter(-1, top.indices, top.values)  # (B, T, E): others 0
    if votes is not None:
        kept = kept * votes[..., None]
    mass = pad_blocks(kept, block_size).sum(2)  # (B, n_blocks, E)
    return mass / mass.sum(-1, keepdim=True).clamp_min(torch.finfo(mass.dtype).tiny)


def block_routing(scores, top_k: int, block_size: int, threshold: float, guard: int, votes=None):
    """The coreset mask (B, n_blocks, E) bool of every block, from router scores (B, T, E) and
    optionally each token's vote (B, T) in its block's mass (default: 1 each, the paper's rule)."""
    check_block_routing(scores, top_k, block_size, threshold, guard)
    E = scores.shape[-1]
    mass, order = block_mass(scores.float(), top_k, block_size, votes).sort(dim=-1, descending=True, stable=True)
    before = torch.cat([torch.zeros_like(mass[..., :1]), mass.cumsum(-1)[..., :-1]], -1)  # mass ranked above
    # An expert joins while the mass ranked above it is short of the threshold: so the first always
    # joins, and so does the one that crosses. Both conditions only turn False further down the
    # ranking, so the kept experts form a prefix. Zero-mass experts (no token chose them) never join,
    # which also absorbs float rounding at threshold 1.0.
    keep = (before < threshold) & (mass > 0)
    keep |= torch.arange(E, device=scores.device) < guard  # the guard: at least the top-guard experts
    return torch.zeros_like(keep).scatter(-1, order, keep)  # back from rank order to expert ids


def route(scores, top_k: int, coreset=None, block_size: int = 1):
    """Each token's experts and mixing weights, both (B, T, k): its top-k scores (within its block's
    coreset when one is given), renormalised to sum to 1."""
    if coreset is not None:
        check_coreset(coreset, top_k)
        allowed = coreset.repeat_interleave(block_size, dim=1)[:, -scores.shape[1]:]  # (B, T, E)
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights, experts = scores.topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), experts


def switch_balance(probs, experts, n_experts: int):
    """Switch Transformer's load-balancing term E * sum_i f_i * P_i for probs (B, T, E), experts (B, T, k)."""
    P = probs.reshape(-1, n_experts).mean(0)  # (E,) differentiable
    f = torch.bincount(experts.flatten(), minlength=n_experts).float() / experts.numel()  # (E,) counts
    return n_experts * (f * P).sum()


def dispatch(flat, mix, chosen, n_experts: int, run_expert):
    """sum_j mix[:, j] * expert chosen[:, j] (flat) for tokens flat (N, D), mixing weights and expert ids
    (N, k): a loop over experts, run_expert(e, rows (n_e, D)) -> (n_e, D); an expert no token chose
    is never read."""
    out = torch.zeros_like(flat)  # (N, D)
    for e in range(n_experts):
        rows, slot = (chosen == e).nonzero(as_tuple=True)  # tokens routed to e, and which of their k
        if len(rows) == 0:
            continue  # this expert's weights are never read
        y = run_expert(e, flat.index_select(0, rows))  # (n_e, D)
        out.index_add_(0, rows, (y * mix[rows, slot, None]).to(out.dtype))
    return out


class MoEFeedForward(nn.Module):
    """E SwiGLU experts, a router and an optional shared expert; a drop-in for `Block.ffn`."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        expert = ModelConfig(d_model=config.d_model, d_ff=config.expert_d_ff)
        self.router = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleList(FeedForward(expert) for _ in range(config.n_experts))
        self.shared = FeedForward(expert) if config.shared_expert else None
        self.n_experts = config.n_experts
        self.top_k = config.moe_top_k
        self.routing = config.routing
        self.block_size = config.route_block
        self.threshold = config.route_threshold
        self.guard = config.route_guard
        self.votes = None  # (B, T) each token's vote in its block's mass; MoETransformer sets it per forward
        self.balance_loss = torch.zeros(())  # Switch term of the latest forward
        self.last = {}  # the latest forward's routing: scores (B, T, E), weights, experts (B, T, k), coreset
        self.stacked = None  # the experts' weights stacked for the kernel (kernels.moe_ffn.stacked_experts)

    def forward(self, x):
        B, T, D = x.shape
        logits = self.router(x).to(wide(self.router.weight.dtype))  # (B, T, E): float32 under autocast too
        scores = logits.softmax(-1)
        coreset = None
        if self.routing == "block":
            coreset = block_routing(scores, self.top_k, self.block_size, self.threshold, self.guard, self.votes)
        weights, experts = route(scores, self.top_k, coreset, self.block_size)  # (B, T, k) each
        flat = x.reshape(B * T, D)
        out = self.routed(flat, weights.view(B * T, -1), experts.view(B * T, -1))  # (B*T, D)
        if self.shared is not None:
            out = out + self.shared(flat)
        self.balance_loss = switch_balance(scores, experts, self.n_experts)
        self.last = {"scores": scores.detach(), "weights": weights.detach(), "experts": experts, "coreset": coreset}
        return out.view(B, T, D)

    def routed(self, flat, mix, chosen):
        """The routed experts' output (N, D) for tokens flat (N, D), mixing weights and expert ids (N, k).
        (tinydiff/fp4.py's QuantizedMoEFeedForward replaces this with its packed experts.)"""
        if kernels.for_inference(flat):  # one launch for all experts, not E
            from tinydiff.kernels.moe_ffn import moe_ffn, stacked_experts  # lazily: see kernels/__init__.py
            return moe_ffn(flat, mix, chosen, *stacked_experts(self))
        self.stacked = None  # an optimizer step may follow this forward: restack after it
        return dispatch(flat, mix, chosen, self.n_experts, lambda e, rows: self.experts[e](rows))

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (what dispatching to it reads)."""
        return sum(p.numel() * p.element_size() for p in self.experts[0].parameters())


def unique_experts(experts, n_experts: int, block_size: int):
    """Distinct experts each block's tokens read, (B, n_blocks), from the experts (B, T, k) they were routed
    to (blocks counted back from the end, as routing counts them): dMoE's measure of what a block costs."""
    used = torch.zeros(*experts.shape[:2], n_experts, dtype=torch.bool, device=experts.device)
    used.scatter_(-1, experts, True)  # (B, T, E)
    return pad_blocks(used, block_size).any(2).sum(-1)


class MoETransformer(Transformer):
    """The project's Transformer with every block's `ffn` a MoEFeedForward (model.py unchanged)."""

    def __init__(self, config: MoEConfig):
        check_moe_model(config)
        super().__init__(config)
        for block in self.blocks:
            block.ffn = MoEFeedForward(config)
            gpt2_init_(block.ffn, config.n_layer)  # as Transformer's

    def forward(self, idx, **kwargs):
        """Transformer.forward; first gives every MASK position of idx (B, T) its vote in block routing.
        The layers see hidden states only, so which positions are still MASK is told them here."""
        vote = self.config.route_mask_vote
        votes = None if vote == 1 else torch.where(idx == MASK, vote, 1.0)  # (B, T)
        for layer in moe_layers(self):
            layer.votes = votes
        return super().forward(idx, **kwargs)


def moe_layers(model) -> list[MoEFeedForward]:
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not layers:
        raise UserError("this model has no MoE layers; build it with MoETransformer(moe_config(...))")
    return layers


def set_routing(model, routing: str, threshold=None, guard=None, block_size=None, mask_vote=None) -> MoEConfig:
    """Switch every MoE layer to `routing` ("token" or "block"; None keeps a setting); model.config becomes
    a new MoEConfig recording the routing (save it in the checkpoint)."""
    layers = moe_layers(model)
    given = dict(route_threshold=threshold, route_guard=guard, route_block=block_size, route_mask_vote=mask_vote)
    config = replace(model.config, routing=routing, **{k: v for k, v in given.items() if v is not None})  # re-checked
    if config.causal and routing == "block":
        raise UserError(CAUSAL_ROUTING)
    model.config = config
    for layer in layers:
        layer.routing = config.routing
        layer.threshold = config.route_threshold
        layer.guard = config.route_guard
        layer.block_size = config.route_block
    return config


def balance_loss(model):
    """The layers' Switch terms of the latest forward, summed (L when perfectly balanced)."""
    return sum(layer.balance_loss for layer in moe_layers(model))


def mdlm_moe_loss(model, x, generator=None, base=diffusion_loss):
    """base (diffusion_loss: MDLM's, or block diffusion's) + balance_coef * balance_loss(model); (loss, stats).

    stats: elbo and masked_ce as in mdlm_loss (the bound excludes the balance term), and balance:
    the Switch term per layer (mean over layers; 1 = perfectly balanced, E = collapsed).
    """
    loss, stats = base(model, x, generator)
    balance = balance_loss(model)
    stats["balance"] = balance.detach() / len(moe_layers(model))
    return loss + model.config.balance_coef * balance, stats


EXPERTS = Rule(integer=True, lo=1, hi=4096)
MOE_RULES = {"n_experts": EXPERTS, "moe_top_k": EXPERTS, "shared_expert": bool, "balance_coef": WEIGHT,
             "route_block": SIZE, "route_threshold": MASS, "route_guard": EXPERTS, "route_mask_vote": POSITIVE}


def check_routing(routing, guard, top_k, n_experts):
    """What MOE_RULES cannot say alone: the settings against each other."""
    if not top_k <= n_experts:
        raise UserError(f"need 1 <= top_k <= n_experts, got top_k {top_k} with {n_experts} experts")
    if routing not in ROUTINGS:
        raise UserError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    if not top_k <= guard <= n_experts:
        raise UserError(f"the guard must lie in [top_k, n_experts] = [{top_k}, {n_experts}] (a token "
                        f"needs {top_k} experts in its block's coreset), got {guard}")


def check_moe_model(config):
    if not isinstance(config, MoEConfig):
        raise UserError(f"MoETransformer needs a MoEConfig (see moe_config), got {type(config).__name__}")
    if config.expert_format != "float":
        raise UserError(f"this config's experts are packed {config.expert_format}: build the model with "
                        "tinydiff.fp4.moe_model(config), as load_model does")
    if config.causal and config.routing == "block":  # the model's attention: a layer's config need not know it
        raise UserError(CAUSAL_ROUTING)


def check_block_routing(scores, top_k: int, block_size: int, threshold: float, guard: int):
    """block_routing's arguments, for a caller that does not come through MoEConfig's checks."""
    if scores.dim() != 3:
        raise UserError(f"scores must have shape (B, T, E), got {tuple(scores.shape)}")
    E = scores.shape[-1]
    if not 1 <= top_k <= E or not 1 <= guard <= E or block_size < 1 or not 0 < threshold <= 1:
        raise UserError(f"need 1 <= top_k, guard <= E ({E}), block_size >= 1, threshold in (0, 1]; got "
                        f"top_k {top_k}, guard {guard}, block_size {block_size}, threshold {threshold}")


def check_coreset(coreset, top_k: int):
    if int(coreset.sum(-1).min()) < top_k:
        raise UserError(f"every coreset needs >= top_k ({top_k}) experts; raise the guard")
