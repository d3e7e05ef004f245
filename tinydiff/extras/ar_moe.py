"""The AR mixture-of-experts LM (`train.py --model ar-moe`): a target for speculative decoding.

Xiaomi's MiMo serves a causal MoE and drafts for it with a DFlash drafter; this is that target at
our scale. It is dmoe.py's MoETransformer with causal attention: every block's feed-forward is a
top-k token-routed mixture of SwiGLU experts (and a shared one); each position is routed on its
own hidden state, so the KV cache, speculative verification (spec, DFlash, DDTree, EAGLE-3) and
hidden-state features work as for the dense AR model. The loss is ar.py's next-token cross-entropy
plus balance_coef times the layers' Switch load-balancing terms, as mdlm_moe_loss adds them to the
diffusion loss. `python -m tinydiff.tools.quantize` packs its experts in MXFP4 / NVFP4
(tinydiff/fp4.py) after training; a drafter trained against the float model drafts for
the packed one (same dimensions, same feature layers: drafter.check_target).

Leaves out: block routing (a diffusion LM's idea: its blocks are counted back from the end of the
sequence, which a token-by-token KV cache never sees; MoETransformer and set_routing refuse it),
multi-token prediction heads (MiMo's MTP), and everything dmoe.py leaves out.
"""
from tinydiff.ar import ar_loss
from tinydiff.dmoe import MoEConfig, balance_loss, moe_config, moe_layers


def ar_moe_config(name: str, **overrides) -> MoEConfig:
    """A causal MoE variant of preset `name`, token-routed, with the dense model's active FFN size."""
    return moe_config(name, **{**overrides, "causal": True})


def ar_moe_loss(model, windows, generator=None, base=ar_loss):
    """base(model, windows) (ar_loss: next-token cross-entropy on windows (B, T+1)) + balance_coef *
    balance_loss(model); (loss, stats).

    stats: base's (ce: with ar_loss, the next-token cross-entropy, the balance term left out, so
    exp(ce) is the perplexity), and balance: the Switch term per layer (mean over layers; 1 =
    perfectly balanced, E = collapsed). `generator` is unused, as in ar_loss. QAT against the
    full-precision model (tinydiff/extras/qat.py) passes soft_labels.soft_ar_loss as `base`.
    """
    loss, stats = base(model, windows, generator)
    balance = balance_loss(model)
    stats["balance"] = balance.detach() / len(moe_layers(model))
    return loss + model.config.balance_coef * balance, stats
