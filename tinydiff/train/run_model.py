"""The model a training run trains, from its settings (tinydiff/train/run_config.py): fresh from a
preset, continued from --init's weights (an AR checkpoint adapted to diffusion with Dream's shift),
a drafter around a frozen --target, an AR draft from --target's first layers, a distillation student,
or the checkpoint of a resumed run.
Shape flags that contradict --init's checkpoint are errors, never silently ignored.
"""
from dataclasses import replace

import torch

from tinydiff.checks import UserError
from tinydiff.io.checkpoint import (
    AR_KINDS,
    DIFFUSION_KINDS,
    MOE_KINDS,
    drafter_from,
    head_from,
    load_checkpoint,
    load_model,
    model_from,
)
from tinydiff.io.cli import flag
from tinydiff.model import Transformer, preset
from tinydiff.tokenizer import EOT
from tinydiff.train.run_config import DRAFTERS


def load_target(run: dict, device: str, context: int = 0):
    """The frozen target a drafter (DFlash, EAGLE-3, an AR draft) or an ar-moe QAT run trains against:
    an AR model (dense or MoE) that must read windows of `context` tokens, or for an AR draft a
    diffusion LM, whose left-to-right sampler the draft will draft for (drafted_diffusion.py)."""
    if not run["target"]:
        raise UserError(f"--model {run['model']} {'--regenerate ' if run['regenerate'] else ''}needs --target CKPT, "
                        "the model to draft for")
    kinds = AR_KINDS + (DIFFUSION_KINDS if run["model"] == "ar" else ())
    target, _ = load_model(run["target"], device, kinds=kinds)
    if target.config.causal and target.config.context < context:
        raise UserError(f"--target {run['target']} reads {target.config.context} tokens, this run's windows "
                        f"{context}: pass --context {target.config.context} or a target with a longer context")
    return target.requires_grad_(False)


def init_checkpoint(run: dict) -> dict:
    """--init's checkpoint, when it holds the run's kind of model (or AR weights for an MDLM to adapt)."""
    init = load_checkpoint(run["init"])
    if init["kind"] != run["model"] and not (init["kind"] == "ar" and run["model"] == "mdlm"):
        raise UserError(f"--init {run['init']} holds a {init['kind']} model, not {run['model']}")
    return init


def check_init_shape(run: dict, config, wanted: dict):
    """A model continued from --init keeps its shape: a flag asking for another one is an error."""
    for key, value in wanted.items():
        if getattr(config, key, 0) != value:  # a plain DFlash config has no markov_rank: rank 0
            name = {"n_layer": "drafter_layers", "n_experts": "experts", "moe_top_k": "top_k"}.get(key, key)
            raise UserError(f"--init {run['init']} has {key} {getattr(config, key)}, this run asks for {value}; "
                            f"pass {flag(name)} to match, or start without --init")


def check_flags_fit(run: dict):
    """Each model-specific flag is given only to the model it applies to, never silently ignored."""
    dflash_flags = run["feature_layers"] or run["drafter_layers"] is not None or run["markov_rank"] is not None
    if dflash_flags and run["model"] != "dflash":
        raise UserError("--feature-layers, --drafter-layers and --markov-rank apply to --model dflash only "
                        "(EAGLE-3: one layer fusing 3 fixed target layers)")
    if run["noise_block"] is not None and not run["model"].startswith("mdlm"):
        raise UserError("--noise-block applies to --model mdlm and mdlm-moe only")
    if (run["experts"] is not None or run["top_k"] is not None) and run["model"] not in MOE_KINDS:
        raise UserError("--experts and --top-k apply to --model mdlm-moe and ar-moe only")
    if run["routing"] != "token" and run["model"] not in MOE_KINDS:
        raise UserError("--routing applies to --model mdlm-moe only")
    if run["routing"] == "block" and run["model"] == "ar-moe":
        raise UserError("--routing block is for diffusion LMs (mdlm-moe); --model ar-moe routes by token")
    if run["target"] and not uses_target(run):
        raise UserError(f"--model {run['model']} does not use --target here: it is the model a draft learns "
                        "(dflash, eagle3, or ar with --regenerate or --draft-temperature), or the full-precision "
                        "model an ar-moe --qat run learns to match")
    if run["qat"] is not None and run["model"] not in MOE_KINDS:
        raise UserError("--qat fake-quantizes the experts of a mixture-of-experts model: use --model mdlm-moe or "
                        "ar-moe (and --init its full-precision checkpoint)")
    if run["distill"] and run["model"] not in DIFFUSION_KINDS:
        raise UserError(f"--distill trains a diffusion LM student; --model {run['model']} is not one")
    if run["regenerate"] is not None and run["model"] not in (*DRAFTERS, "ar"):
        raise UserError("--regenerate trains a draft on its target's text: use --model dflash, eagle3 or ar "
                        "with --target")


def uses_target(run: dict) -> bool:
    """Whether the run trains against a frozen --target: a drafter, an AR draft on the target's text
    or distribution or from its first layers, or an ar-moe QAT run matching its full-precision model (tinydiff/extras/qat.py)."""
    return (run["model"] in DRAFTERS or (run["model"] == "ar" and (run["regenerate"] is not None or
                                                                    run["draft_temperature"] is not None or
                                                                    run["target_layers"] is not None))
            or (run["model"] == "ar-moe" and run["qat"] is not None))


def build_model(run: dict, device: str, ckpt=None, path=None):
    """The run's model: from its checkpoint when resuming, else fresh (or --init's weights)."""
    check_flags_fit(run)
    if run["model"] in DRAFTERS:
        return build_drafter(run, device, ckpt, path)
    if ckpt is not None:  # resuming: the checkpoint's model, as it was saved
        model = model_from(ckpt, path, device)
    else:
        model = with_run_options(new_language_model(run, device), run)
    if run["qat"] is not None:  # every start of the run, resumed ones too: the experts compute fake-quantized
        from tinydiff.extras.qat import fake_quantize_experts
        fake_quantize_experts(model, run["qat"])
    return model


def build_drafter(run: dict, device: str, ckpt=None, path=None):
    """A DFlash drafter or an EAGLE-3 head around the frozen --target: fresh, resumed, or --init's."""
    from_init = run["init"] and ckpt is None
    if from_init:  # a new run that continues a drafter's weights
        ckpt, path = init_checkpoint(run), run["init"]
    target = load_target(run, device)
    if run["model"] == "dflash":
        from tinydiff.dflash import DFlashConfig, DFlashDrafter
        given = {"feature_layers": run["feature_layers"], "n_layer": run["drafter_layers"],
                 "markov_rank": run["markov_rank"]}
        overrides = {key: value for key, value in given.items() if value is not None}
        if ckpt is None and overrides.get("markov_rank"):  # DSpark's Markov head (extras/markov_head.py)
            from tinydiff.extras.markov_head import MarkovConfig, MarkovDrafter
            return MarkovDrafter(MarkovConfig.for_target(target.config, block_size=run["block_size"], **overrides),
                                 target)
        if ckpt is None:
            overrides.pop("markov_rank", None)  # rank 0: plain DFlash
            return DFlashDrafter(DFlashConfig.for_target(target.config, block_size=run["block_size"], **overrides),
                                 target)
        if (ckpt.get("config") or {}).get("markov_rank"):  # a drafter with the head: the variant rebuilds it
            from tinydiff.extras.markov_head import drafter_from as markov_drafter_from
            drafter = markov_drafter_from(ckpt, target, path)
        else:
            drafter = drafter_from(ckpt, target, path)
        wanted = {"block_size": run["block_size"], **overrides}
    else:
        from tinydiff.eagle3 import EagleConfig, EagleHead
        if ckpt is None:
            return EagleHead(EagleConfig.for_target(target.config, steps_ahead=run["steps_ahead"]), target).to(device)
        drafter, wanted = head_from(ckpt, target, path), {"steps_ahead": run["steps_ahead"]}
    if from_init:
        check_init_shape(run, drafter.config, wanted)
    return drafter


def new_language_model(run: dict, device: str):
    """A new run's AR or diffusion LM: a distillation student, --init's weights (an AR checkpoint
    adapted to diffusion), or fresh from the preset."""
    moe_shape = {key: value for key, value in (("n_experts", run["experts"]), ("moe_top_k", run["top_k"]))
                 if value is not None}
    overrides = {} if run["context"] is None else {"context": run["context"]}
    if run["distill"]:
        from tinydiff.extras.distill import student_from
        return student_from(run["distill"], run["model"], run["init"], device)
    if run["target_layers"]:
        return early_exit_draft(run, device)
    if run["init"]:
        init = init_checkpoint(run)
        model = model_from(init, run["init"], device)
        check_init_shape(run, model.config, moe_shape)
        if init["kind"] == "ar" and run["model"] == "mdlm":  # AR-to-diffusion adaptation (Dream 7B): the AR
            # weights, bidirectional attention, and the AR head's alignment kept (output i predicts token i+1)
            model.config = replace(model.config, causal=False, shift=True)
        return model
    if run["model"] in MOE_KINDS:  # ar-moe: dmoe.py's model with causal attention (extras/ar_moe.py)
        from tinydiff.dmoe import MoETransformer, moe_config
        config = moe_config(run["preset"], **overrides, **moe_shape, causal=run["model"] == "ar-moe")
        return MoETransformer(config).to(device)
    return Transformer(preset(run["preset"], causal=run["model"] == "ar", **overrides)).to(device)


def early_exit_draft(run: dict, device: str):
    """An AR draft made of the dense AR --target's first --target-layers blocks, its embedding, final
    norm and head (LayerSkip's early exit, Elhoushi et al. 2024): the exit already predicts the next
    token, so the draft starts near the target's distribution instead of from noise."""
    target, _ = load_model(run["target"], device, kinds=("ar",))
    n = run["target_layers"]
    if n >= target.config.n_layer:
        raise UserError(f"--target-layers {n}: {run['target']} has {target.config.n_layer} layers; a draft of "
                        f"its first 1 to {target.config.n_layer - 1} is cheaper than it")
    draft = Transformer(replace(target.config, n_layer=n)).to(device)
    kept = {key: value for key, value in target.state_dict().items()
            if not key.startswith("blocks.") or int(key.split(".")[1]) < n}
    draft.load_state_dict(kept)  # strict: every weight of the draft comes from the target
    return draft


def with_run_options(model, run: dict):
    """The run's expert routing (mdlm-moe, ar-moe) and its noise blocks (None keeps --init's objective)."""
    if run["model"] in MOE_KINDS:
        from tinydiff.dmoe import set_routing
        set_routing(model, run["routing"], threshold=run["route_threshold"], guard=run["route_guard"],
                    mask_vote=run["route_mask_vote"])
    if run["noise_block"] is not None:
        block, context = run["noise_block"], model.config.context
        if block < 0 or (block and context % block):
            raise UserError(f"--noise-block takes 0 (one noise level per window) or a block that divides the "
                            f"context of {context}; got {block}")
        model.config = replace(model.config, noise_block=block)
    return model


def describe(model, run: dict):
    """One line: what the run trains and how many parameters it has."""
    config = model.config
    if run["model"] in DRAFTERS:
        shape = f"B {config.block_size}" if run["model"] == "dflash" else f"K {config.steps_ahead}"
        print(f"model: {run['model']} drafter ({shape}, features {config.feature_layers}) for {run['target']} | "
              f"params {sum(p.numel() for p in model.parameters()):,} (the target's embedding and head are borrowed)")
    else:
        name = run["preset"]
        if run["distill"]:
            name = f"student of {run['distill']}"
        elif run["init"]:
            name = f"from {run['init']}"
        elif run["target_layers"]:
            name = f"from the first {run['target_layers']} layers of {run['target']}"
        print(f"model: {run['model']} {name} | params {model.num_params():,} "
              f"({model.num_params(embedding=False):,} without the embedding) | context {config.context}")


@torch.no_grad()
def sample_story(model, kind: str, tokenizer, seed: int) -> str:
    """A short story from the model as it is now: the same prompt and seed at every evaluation."""
    model.eval()
    try:
        return story(model, kind, tokenizer, seed)
    finally:
        model.train()


def story(model, kind: str, tokenizer, seed: int) -> str:
    prompt = [EOT] + tokenizer.encode("Once upon a time")
    n = min(48, model.config.context - len(prompt))  # RunConfig's least context leaves room for 11
    block = model.config.noise_block if kind.startswith("mdlm") else 0
    if block and n < block:
        return f"(none: a block of {block} does not fit after the prompt in a context of {model.config.context})"
    if kind in DRAFTERS:  # a drafter's worth is its acceptance: greedy tau on this prompt (EAGLE-3: 4-token chains)
        if getattr(model.config, "markov_rank", 0):
            from tinydiff.extras.markov_head import markov_dflash_generate as decode
        elif kind == "dflash":
            from tinydiff.dflash import dflash_generate as decode
        else:
            from tinydiff.eagle3 import eagle_generate as decode
        ids, result = decode(model.target, model, prompt, n, stop_token=None, **({"k": 4} if kind == "eagle3" else {}))
        return f"tau {result.tau:.2f} (accepted {result.accepted}): Once upon a time{tokenizer.decode(ids)}"
    generator = torch.Generator(model.embed.weight.device).manual_seed(seed)
    if kind.startswith("mdlm"):  # sampled as it was trained: block by block, or the whole window at once
        from tinydiff.sampler import generate, generate_cached
        if block:
            n -= n % block
            ids, _ = generate_cached(model, prompt, gen_length=n, steps=n, block_length=block, generator=generator)
        else:
            ids, _ = generate(model, prompt, gen_length=n, steps=n, block_length=n, generator=generator)
    else:
        from tinydiff.ar import ar_generate
        ids, _ = ar_generate(model, prompt, n, temperature=0.8, top_k=50, generator=generator)
    return "Once upon a time" + tokenizer.decode(ids[:ids.index(EOT)] if EOT in ids else ids)
