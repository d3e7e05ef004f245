"""The model a checkpoint holds, rebuilt: each kind's config and model classes (every kind but the
MoE diffusion LM is the plain Transformer; the drafters are rebuilt around their target by
dflash.drafter_from and eagle.head_from), the config checked for fields this code does not know,
and the weights checked to fit it.
"""
from dataclasses import fields

from tinydiff.checkpoint import brief_error, load_checkpoint
from tinydiff.dmoe import MoEConfig, MoETransformer
from tinydiff.errors import UserError
from tinydiff.model import ModelConfig, Transformer

# kind -> (config class, model class); every other kind is a plain Transformer
ARCHITECTURES = {"mdlm-moe": (MoEConfig, MoETransformer)}


def config_from(ckpt: dict, path="checkpoint") -> ModelConfig:
    config_class, _ = ARCHITECTURES.get(ckpt.get("kind"), (ModelConfig, Transformer))
    known = {f.name for f in fields(config_class)}
    unknown = set(ckpt["config"]) - known
    if unknown:
        raise UserError(f"{path}: config has fields this code does not know ({', '.join(sorted(unknown))})")
    return config_class(**ckpt["config"])


def model_from(ckpt: dict, path="checkpoint", device="cpu") -> Transformer:
    """Build the model a checkpoint describes and load its weights."""
    _, model_class = ARCHITECTURES.get(ckpt.get("kind"), (ModelConfig, Transformer))
    model = model_class(config_from(ckpt, path))
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise UserError(f"{path}: weights do not fit its config ({brief_error(e)})") from None
    return model.to(device)


def load_model(path, device="cpu", kinds=None):
    """(model in eval mode, checkpoint dict); `kinds` lists the acceptable checkpoint kinds."""
    ckpt = load_checkpoint(path)
    if kinds is not None and ckpt.get("kind") not in kinds:
        raise UserError(f"{path} holds a {ckpt.get('kind')!r} model; this needs one of: {', '.join(kinds)}")
    return model_from(ckpt, path, device).eval(), ckpt
