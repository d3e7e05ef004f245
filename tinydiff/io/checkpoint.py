"""Checkpoints: atomic save, safe load, and the model of each kind rebuilt from one.

A checkpoint is a plain dict of tensors and Python primitives, so `torch.load(weights_only=True)`
can read it without unpickling code:
  format, version   marks the file as ours
  kind              "ar", "mdlm", "mdlm-moe", "ar-moe", "dflash", "eagle3": which objective trained it
                    (or "sudoku-mdlm", "sudoku-ar": the Sudoku lesson's models, which also record their "board")
  config            the ModelConfig as a dict
  model             the state dict
  optimizer         AdamW state (absent in weights-only exports)
  precision         the training dtype, its gradient scaler's state and the steps it skipped (fp16)
  step              optimizer steps taken
  rng               torch CPU (and CUDA) generator states
  data              where the data stream is: {"seed", "index"} of the next batch, and "tokens",
                    the sha256 of the token files (a resumed run must read the same data)
  args              the training settings, so --resume continues the same run
Saving goes through tinydiff/io/files.py's atomic write (a temp file beside it, fsynced, renamed over
it): a crash mid-save leaves the previous checkpoint intact, and a full disk is one line. Loading
checks every key's type and the weights' values before anything is built (check_contents).
A folder written by `python -m tinydiff.tools.export` (or a Llama folder transformers saved) loads into
the same dict, without the training state (tinydiff/io/hf_format.py reads it; no pickle involved).

Rebuilding the model: every kind but mdlm-moe and ar-moe is the plain Transformer; the drafters are
rebuilt around their target (drafter_from, head_from). The config is checked before a weight is
allocated (its classes' own rules); one that implies more weights than the file holds is matched, name
by name and shape by shape, against a model built on the "meta" device, which costs no memory, so a
tampered config cannot make this machine allocate what the file does not hold (a config whose size
agrees with the file skips it: "meta" imports torch's compiler, about 1.5 s).
An embedding of the true vocabulary's rows is padded on load (pad_vocabulary).
"""
import re
import warnings
from dataclasses import asdict, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from tinydiff.checks import COUNT_OR_NONE, UserError, brief_error
from tinydiff.model import ModelConfig, Transformer, padded_vocab
from tinydiff.tokenizer import VOCAB_SIZE

FORMAT = "tinydiff-checkpoint"
VERSION = 2  # 1: DFlash feature ids counted blocks, where a field did not say otherwise (dflash_config)
KINDS = ("mdlm", "ar", "mdlm-moe", "ar-moe", "dflash", "eagle3")  # what train.py trains
SUDOKU_KINDS = ("sudoku-mdlm", "sudoku-ar")  # the Sudoku lesson's models (tinydiff/extras/sudoku_train.py)


def save_checkpoint(path, *, kind: str, config: ModelConfig, model, **extra):
    """Atomically write a checkpoint; `extra` adds optimizer, step, rng, data, args, ..."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, "kind": kind, "config": asdict(config),
               "model": model.state_dict(), **extra}

    def write(f):
        try:
            torch.save(payload, f)
        except RuntimeError as e:  # torch's zip writer reports a full disk as a RuntimeError
            raise OSError(f"torch.save stopped part way, is the disk full? {brief_error(e, 80)}") from None

    from tinydiff.io.files import write_atomic  # what loads a checkpoint never imports what writes one
    write_atomic(path, write)


def load_checkpoint(path, map_location="cpu", kinds=None) -> dict:
    """Read and validate a checkpoint (a .pt file, or a folder `python -m tinydiff.tools.export` wrote) of one
    of `kinds` (None: any); every failure is a UserError that names the file."""
    ckpt = read_checkpoint(Path(path), map_location)
    if kinds is not None and ckpt["kind"] not in kinds:
        raise UserError(f"{path} holds a {ckpt['kind']} model; this needs {' or '.join(dict.fromkeys(kinds))}")
    return ckpt


def read_checkpoint(path: Path, map_location) -> dict:
    if path.is_dir() and (path / "config.json").is_file():  # an exported folder (tinydiff/io/hf_format.py)
        from tinydiff.io.hf_format import read_folder
        ckpt = {"format": FORMAT, "version": VERSION, **read_folder(path)}
        check_contents(ckpt, path)
        return pad_vocabulary(ckpt)
    if path.is_dir():
        hint = "pass the ckpt.pt inside a run folder, or a folder written by `python -m tinydiff.tools.export`"
        if (path / "ckpt.pt").is_file():
            hint = f"pass {path / 'ckpt.pt'}"
        raise UserError(f"checkpoint {path} is a folder; {hint}")
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found; pass the ckpt.pt written by train.py (e.g. out/ar-tiny/ckpt.pt)")
    try:
        with warnings.catch_warnings():  # torch warns about foreign pickles; the one line below says it all
            warnings.simplefilter("ignore")
            ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types on garbage bytes
        refused = re.search(r"[Uu]nsupported (?:GLOBAL|global:) (\S+)", str(e))
        if refused:  # what the weights-only unpickler refuses: code, or objects that are not tensors
            raise UserError(f"{path} holds Python objects that are not tensors ({refused[1]}), which tinydiff "
                            "never unpickles; pass a checkpoint written by train.py") from None
        detail = re.search(r"WeightsUnpickler error:\s*(.+?)\s*Check the documentation", str(e), re.S)
        raise UserError(f"{path} is not a readable checkpoint (truncated or not a torch file: "
                        f"{brief_error(detail[1] if detail else e)}); re-run training or pick another file") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise UserError(f"{path} is not a tinydiff checkpoint (no '{FORMAT}' marker); pass one written by train.py")
    if ckpt.get("version") not in (1, VERSION):
        raise UserError(f"{path} has checkpoint version {ckpt.get('version')!r}, this code reads 1 and {VERSION}")
    check_contents(ckpt, path)
    return pad_vocabulary(ckpt)


def check_contents(ckpt: dict, path):
    """What a checkpoint holds, before anything is built from it: each key's type, a known kind, a
    step count, finite weights (the config's values are checked by its class, in kinds.config_from)."""
    if ckpt.get("kind") not in KINDS + SUDOKU_KINDS:
        raise UserError(f"{path} names no model kind this code knows (kind {ckpt.get('kind')!r}, not one of "
                        f"{', '.join(KINDS + SUDOKU_KINDS)}); pass a checkpoint written by train.py")
    config, weights = ckpt.get("config"), ckpt.get("model")
    if not isinstance(config, dict) or not all(isinstance(key, str) for key in config):
        raise UserError(f"{path} has no model config (a dict of settings): it is damaged; pass another checkpoint")
    if not isinstance(weights, dict) or not weights or not all(
            isinstance(key, str) and isinstance(value, torch.Tensor) for key, value in weights.items()):
        raise UserError(f"{path} has no weights (a dict of named tensors): it is damaged; pass another checkpoint")
    for key in ("args", "optimizer", "rng", "data", "precision"):
        if key in ckpt and not isinstance(ckpt[key], dict):
            raise UserError(f"{path}: its {key} is a {type(ckpt[key]).__name__}, not a dict: it is damaged")
    if "step" in ckpt:
        COUNT_OR_NONE.check(f"{path}: the step count", ckpt["step"])
    if "rng" in ckpt and not all(isinstance(s, torch.Tensor) and s.dtype == torch.uint8 for s in ckpt["rng"].values()):
        raise UserError(f"{path}: its random-number states are not byte tensors: it is damaged")
    bad = next((key for key, value in weights.items() if value.is_floating_point() and not bool(value.isfinite().all())),
               None)
    if bad is not None:
        raise UserError(f"{path}: weight {bad} holds NaN or inf (the training diverged); use an earlier checkpoint, "
                        "or train again with a lower --lr")


def pad_vocabulary(ckpt: dict) -> dict:
    """An embedding of the true vocabulary's rows (an export, or a checkpoint from before the padding) and the
    optimizer's moments of it padded with zero rows (model.padded_vocab): the padding is never read."""
    embed, vocab = ckpt["model"].get("embed.weight"), ckpt["config"].get("vocab_size")
    if embed is None or embed.dim() != 2 or type(vocab) is not int or embed.shape[0] != vocab:
        return ckpt
    shape, pad = embed.shape, (0, 0, 0, padded_vocab(vocab) - vocab)
    ckpt["model"]["embed.weight"] = F.pad(embed, pad)
    for state in ckpt.get("optimizer", {}).get("state", {}).values():
        if isinstance(state, dict):  # AdamW's exp_avg and exp_avg_sq of the embedding
            state.update({key: F.pad(t, pad) for key, t in state.items() if torch.is_tensor(t) and t.shape == shape})
    return ckpt


MOE_KINDS = ("mdlm-moe", "ar-moe")  # the checkpoint kinds whose model is a MoETransformer (diffusion, causal)
AR_KINDS = ("ar", "ar-moe")  # the causal LMs: what AR decoding, a draft's or drafter's --target and spec decode
DIFFUSION_KINDS = ("mdlm", "mdlm-moe")  # the masked diffusion LMs: what the diffusion samplers decode


def architecture(kind: str):
    """(config class, what builds the model from a config) of a checkpoint kind: the plain Transformer, or for
    the MoE kinds dmoe.py's, with fp4.py's packed experts where the config says so (imported only then)."""
    if kind not in MOE_KINDS:
        return ModelConfig, Transformer
    from tinydiff.dmoe import MoEConfig
    from tinydiff.fp4 import moe_model
    return MoEConfig, moe_model


def config_from(ckpt: dict, path="checkpoint") -> ModelConfig:
    config_class, _ = architecture(ckpt.get("kind"))
    retired = {"score": "softmax"}  # older MoEConfigs' field, at the one value this code computes ("sigmoid" went)
    stored = {k: v for k, v in ckpt["config"].items() if not (k in retired and retired[k] == v)}
    unknown = set(stored) - {f.name for f in fields(config_class)}
    if unknown:
        raise UserError(f"{path}: config has fields this code does not know ({', '.join(sorted(unknown))})")
    try:
        config = config_class(**stored)
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
    if hasattr(config, "n_experts"):
        ffn = 3 * config.d_model * config.expert_d_ff * (config.n_experts + config.shared_expert)
        if config.expert_format != "float":  # FP4 experts: half a byte per weight, plus a scale per block
            ffn = ffn // 2 + ffn // config.expert_block
    return config.vocab_size * config.d_model + config.n_layer * (4 * config.d_model ** 2 + ffn)


def model_from(ckpt: dict, path="checkpoint", device="cpu") -> Transformer:
    """Build the model a checkpoint describes and load its weights."""
    _, model_class = architecture(ckpt.get("kind"))
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
    ckpt = load_checkpoint(path, kinds=kinds)
    return model_from(ckpt, path, device).eval(), ckpt


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


def dflash_config(ckpt: dict, path) -> dict:
    """A DFlash drafter's stored config as this code's DFlashConfig reads it. A drafter saved before ids meant
    a block's output (a version 1 file without `feature_ids`, or with "after_blocks") read its ids after that
    many blocks: id i is block i - 1's output now. A stored markov_rank of 0 (no head) is dropped; above 0 it stays, for
    tinydiff/extras/markov_head.py."""
    config = dict(ckpt["config"])
    ids = config.pop("feature_ids", "after_blocks" if ckpt.get("version", VERSION) == 1 else "block_output")
    if ids not in ("after_blocks", "block_output"):
        raise UserError(f"{path}: the drafter's feature_ids must be after_blocks or block_output, got {ids!r}")
    if ids == "after_blocks" and config.get("feature_layers") is not None:
        if 0 in config["feature_layers"]:
            raise UserError(f"{path}: this drafter reads the target's embeddings (feature id 0 of an old drafter), "
                            "which this code cannot read; train it again")
        config["feature_layers"] = [i - 1 for i in config["feature_layers"]]
    if config.get("markov_rank") == 0:
        del config["markov_rank"]
    return config


def drafter_from(ckpt: dict, target: Transformer, path="checkpoint"):
    """Rebuild a DFlash drafter from {"config": asdict(DFlashConfig), "model": state_dict} around `target`."""
    from tinydiff.dflash import DFlashConfig, DFlashDrafter
    config = dflash_config(ckpt, path)
    if config.get("markov_rank"):
        raise UserError(f"{path} is a DFlash drafter with DSpark's Markov head (a research variant): decode with "
                        "python -m tinydiff.extras.markov_head")
    return rebuild_around(target, {**ckpt, "config": config}, DFlashConfig, DFlashDrafter, "a DFlash drafter", path)


def head_from(ckpt: dict, target: Transformer, path="checkpoint"):
    """Rebuild a head from {"kind": "eagle3", "config": asdict(EagleConfig), "model": state_dict} around `target`."""
    from tinydiff.eagle3 import KIND, EagleConfig, EagleHead
    if ckpt.get("kind", KIND) != KIND:
        raise UserError(f"{path} holds a {ckpt['kind']!r} model, not an EAGLE-3 head ({KIND!r})")
    return rebuild_around(target, ckpt, EagleConfig, EagleHead, "an EAGLE-3 head", path)
