"""What a mixture-of-experts model reads and costs, counted from outside its layers (forward hooks).

dMoE's claim is about what a block forward reads: the distinct experts its tokens were routed to
(dmoe.unique_experts) times the bytes of an expert. `reset_stats(model)` hooks every MoE layer: after
each forward it counts, from the routing the layer kept (`layer.last`), the unique experts per block,
the experts touched by the whole forward, and the layer's time (with `sync_timing`, CUDA waited for at
both ends, so the time is the GPU's). `moe_stats(model)` sums them over the forwards since the reset.
Also here: `param_counts` (total and active parameters) and `routing_from_flags`, the routing flags the
quality tool shares.
"""
import time
import weakref

import torch

from tinydiff.checks import UserError
from tinydiff.dmoe import moe_layers, set_routing, unique_experts
from tinydiff.io.checkpoint import MOE_KINDS

_totals = weakref.WeakKeyDictionary()  # layer -> its counts since the last reset


def reset_stats(model, sync_timing: bool = False):
    """Zero the counts of every MoE layer of `model` and (re)hook them; sync_timing: CUDA synchronized
    around each layer (honest GPU times)."""
    for layer in moe_layers(model):
        old = _totals.get(layer)
        if old is not None:
            for handle in old["hooks"]:
                handle.remove()

        def clock(x):
            if sync_timing and x.is_cuda:
                torch.cuda.synchronize(x.device)
            return time.perf_counter()

        def before(layer, inputs):
            _totals[layer]["start"] = clock(inputs[0])

        def after(layer, inputs, output):
            t, experts = _totals[layer], layer.last["experts"]
            unique = unique_experts(experts, layer.n_experts, layer.block_size)  # (B, n_blocks)
            t["forwards"] += 1
            t["blocks"] += unique.numel()
            touched = torch.zeros(layer.n_experts, dtype=torch.bool, device=experts.device)
            touched[experts.flatten()] = True  # the distinct experts this forward read
            t["unique"] = t["unique"] + unique.sum()  # device tensors add up without waiting for the GPU
            t["touched"] = t["touched"] + touched.sum()
            t["seconds"] += clock(output) - t["start"]

        _totals[layer] = {"forwards": 0, "blocks": 0, "unique": 0, "touched": 0, "seconds": 0.0, "start": 0.0,
                          "hooks": (layer.register_forward_pre_hook(before), layer.register_forward_hook(after))}


def moe_stats(model) -> dict:
    """Counts over the forwards since reset_stats, all layers together.

    unique_experts_per_block: distinct routed experts a block's tokens used, mean over blocks,
    layers and forwards. experts_touched_per_layer: distinct routed experts read by one layer in
    one forward. expert_bytes_per_forward: expert-weight bytes read per model forward (touched
    experts, plus the shared expert, x bytes per expert); expert_bytes_all: every expert's bytes.
    """
    layers = moe_layers(model)
    totals = [_totals.get(layer, {"forwards": 0}) for layer in layers]
    forwards = totals[0]["forwards"]
    per_expert, shared = layers[0].expert_bytes(), int(layers[0].shared is not None)
    out = {"forwards": forwards, "n_experts": layers[0].n_experts, "top_k": layers[0].top_k,
           "routing": layers[0].routing, "expert_bytes_all": len(layers) * (layers[0].n_experts + shared) * per_expert}
    if forwards == 0:
        return out
    touched, seconds = sum(float(t["touched"]) for t in totals), sum(t["seconds"] for t in totals)
    out.update({
        "unique_experts_per_block": sum(float(t["unique"]) for t in totals) / sum(t["blocks"] for t in totals),
        "experts_touched_per_layer": touched / (forwards * len(layers)),
        "expert_bytes_per_forward": (touched / forwards + len(layers) * shared) * per_expert,
        "moe_seconds": seconds, "moe_seconds_per_forward": seconds / forwards})
    return out


def param_counts(model) -> dict:
    """Total and active (used by one token) parameters, with and without the embedding."""
    total, embed = model.num_params(), model.embed.weight.numel()
    idle = sum((layer.n_experts - layer.top_k) * sum(p.numel() for p in layer.experts[0].parameters())
               for layer in moe_layers(model))
    return {"total": total, "active": total - idle, "total_no_embed": total - embed,
            "active_no_embed": total - idle - embed}


def routing_from_flags(model, kind: str, path, routing=None, threshold=None, guard=None, mask_vote=None):
    """A tool's --routing / --route-threshold / --route-guard / --route-mask-vote applied to a loaded
    checkpoint (its saved routing where a flag is not given): the MoEConfig in use, None if dense."""
    asked = [flag for flag, value in (("--routing", routing), ("--route-guard", guard),
                                      ("--route-threshold", threshold), ("--route-mask-vote", mask_vote))
             if value is not None]
    if kind not in MOE_KINDS:
        if asked:
            raise UserError(f"{asked[0]} needs a mixture-of-experts checkpoint ({' or '.join(MOE_KINDS)}); "
                            f"{path} holds a {kind} model")
        return None
    mode = routing or model.config.routing
    tuning = [flag for flag in asked if flag != "--routing"]
    if mode == "token" and tuning:
        raise UserError(f"{tuning[0]} tunes block routing; add --routing block")
    return set_routing(model, mode, threshold, guard, mask_vote=mask_vote)
