"""The model a checkpoint holds, rebuilt: each kind's config and model classes (every kind but the
MoE ones, mdlm-moe and ar-moe, is the plain Transformer; the drafters are rebuilt around their target by
dflash.drafter_from and eagle.head_from). Before a weight is allocated the config is checked (its
fields known, each value in range: the config classes' own rules). A config that implies more
weights than the file holds is then matched, name by name and shape by shape, against a model
built on the "meta" device, which costs no memory: a tampered config cannot make this machine
allocate what the file does not hold. (Building on "meta" imports torch's compiler, about 1.5 s,
so a config whose size agrees with the file skips it: building that model allocates no more than
the file already did.)
"""
from dataclasses import fields

import torch

from tinydiff.checkpoint import brief_error, load_checkpoint
from tinydiff.dmoe import MOE_KINDS, MoEConfig
from tinydiff.fp4_experts import moe_model
from tinydiff.errors import UserError
from tinydiff.model import ModelConfig, Transformer
from tinydiff.tokenizer import VOCAB_SIZE

# kind -> (config class, what builds the model from a config); every other kind is a plain Transformer
ARCHITECTURES = {kind: (MoEConfig, moe_model) for kind in MOE_KINDS}
AR_KINDS = ("ar", "ar-moe")  # the causal LMs: what AR decoding, a draft's or drafter's --target and spec decode
DIFFUSION_KINDS = ("mdlm", "mdlm-moe")  # the masked diffusion LMs: what the diffusion samplers decode


def config_from(ckpt: dict, path="checkpoint") -> ModelConfig:
    config_class, _ = ARCHITECTURES.get(ckpt.get("kind"), (ModelConfig, Transformer))
    known = {f.name for f in fields(config_class)}
    unknown = set(ckpt["config"]) - known
    if unknown:
        raise UserError(f"{path}: config has fields this code does not know ({', '.join(sorted(unknown))})")
    try:
        config = config_class(**ckpt["config"])
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
    if config.vocab_size != VOCAB_SIZE:  # every model read from a file reads this tokenizer's ids
        raise UserError(f"{path} has a vocabulary of {config.vocab_size:,} ids, not the {VOCAB_SIZE:,} of this "
                        "project's tokenizer (GPT-2's and MASK); pass a checkpoint written by train.py")
    return config


def check_weights_fit(shell: torch.nn.Module, weights: dict, path):
    """The checkpoint's weights are exactly the tensors `shell` (a meta-device model) has."""
    want = {name: tuple(t.shape) for name, t in shell.state_dict().items()}
    missing, unexpected = sorted(want.keys() - weights.keys()), sorted(weights.keys() - want.keys())
    wrong = [name for name in want.keys() & weights.keys() if tuple(weights[name].shape) != want[name]]
    if missing or unexpected or wrong:
        detail = (f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(unexpected[:3])}"
                  if unexpected else f"{wrong[0]} is {tuple(weights[wrong[0]].shape)}, its config needs {want[wrong[0]]}")
        raise UserError(f"{path}: weights do not fit its config ({detail}); it is damaged or from another version")


def implied_params(config) -> int:
    """About the parameters a config implies (embedding, attention, feed-forward or experts). Only a
    gate for the exact check: a term it leaves out (norms, routers) costs time, never safety."""
    ffn = 3 * config.d_model * config.d_ff
    if isinstance(config, MoEConfig):
        ffn = 3 * config.d_model * config.expert_d_ff * (config.n_experts + config.shared_expert)
        if config.expert_format != "float":  # FP4 experts: half a byte per weight, plus a scale per block
            ffn = ffn // 2 + ffn // config.expert_block
    return config.vocab_size * config.d_model + config.n_layer * (4 * config.d_model ** 2 + ffn)


def model_from(ckpt: dict, path="checkpoint", device="cpu") -> Transformer:
    """Build the model a checkpoint describes and load its weights."""
    _, model_class = ARCHITECTURES.get(ckpt.get("kind"), (ModelConfig, Transformer))
    config = config_from(ckpt, path)
    if implied_params(config) > 1.1 * sum(t.numel() for t in ckpt["model"].values()):
        with torch.device("meta"):
            shell = model_class(config)
        check_weights_fit(shell, ckpt["model"], path)
    model = model_class(config)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # names or shapes the size gate let through, or dtypes
        raise UserError(f"{path}: weights do not fit its config ({brief_error(e)})") from None
    return model.to(device)


def load_model(path, device="cpu", kinds=None):
    """(model in eval mode, checkpoint dict); `kinds` lists the acceptable checkpoint kinds."""
    ckpt = load_checkpoint(path)
    if kinds is not None and ckpt["kind"] not in kinds:
        wanted = list(dict.fromkeys(kinds))
        raise UserError(f"{path} holds a {ckpt['kind']} model; this needs {' or '.join(wanted)}")
    return model_from(ckpt, path, device).eval(), ckpt
