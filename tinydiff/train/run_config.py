"""The settings of a training run, declared once: train.py's flags, their defaults, the checks on
them and the resume check all come from RunConfig's fields; a resumed run's data is checked too (same_data).

A field is a setting that defines a run: it is saved in the checkpoint (`args`) and read back on
--resume, where a flag that contradicts it is an error. Flags that only say how to run it (--out,
--device, --ckpt-every, --resume, --cache-dir) are train.py's own. A default of None means "decided
elsewhere" (the preset by the device, min_lr from lr, the distillation tuning by DistillConfig).
Checkpoints written before a setting existed lack its key: `migrate` fills it with the value that
reproduces what those runs did (every field's default was chosen to be that value).
"""
import argparse
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from tinydiff.checks import (
    BLOCK,
    COUNT,
    COUNT_OR_NONE,
    DEPTH,
    MASS,
    POSITIVE,
    RATE,
    SEED,
    TEMPERATURE,
    WEIGHT,
    Rule,
    UserError,
    number_list,
)
from tinydiff.io.checkpoint import KINDS, load_checkpoint
from tinydiff.io.cli import check_device, flag
from tinydiff.io.files import check_run_folder
from tinydiff.model import PRESETS

DRAFTERS = ("dflash", "eagle3")  # trained against a frozen --target, which they hold as model.target
DISTILL_TUNING = ("distill_stories", "certainty_weight", "distill_loss", "teacher_temperature", "teacher_order",
                  "anchor_weight")
STUDENT_SHAPE = ("preset", "context", "experts", "top_k", "noise_block")  # a student takes its teacher's
GROUPS = {"drafter": "drafters (dflash, eagle3, or an ar draft with --regenerate)",
          "distill": "distillation for parallel decoding (mdlm, mdlm-moe; tinydiff/extras/distill.py)",
          "moe": "mixture of experts (mdlm-moe; ar-moe: token routing only)"}


# A new run's length when --max-steps / --batch-size are not given. The 13m preset (a GPU's default) trains
# about an hour on a free T4 in fp16, about one pass over TinyStories: an estimate until someone runs it
# (dev/LOG.md, "Sizing the free-GPU run"). Every other run, a CPU's included: 5,000 steps of 32 windows.
RUN_LENGTH = {"13m": {"max_steps": 30000, "batch_size": 64}, None: {"max_steps": 5000, "batch_size": 32}}

# The vocabularies of methods a run may not use, written here so that a run imports a method only when it runs
# it (an AR run loads neither the MoE nor FP4 nor distillation); tests/train/test_run_config.py holds each
# equal to its method's own.
EXPERTS = Rule(integer=True, lo=1, hi=4096)  # dmoe.EXPERTS
FP4_FORMATS = ("mxfp4", "nvfp4")  # fp4.FORMATS
REMASKING = ("low_confidence", "random", "low_entropy", "left_to_right", "top_margin")  # sampler.REMASKING
DISTILL_LOSSES = ("certainty", "tad")  # extras/distill.LOSSES

CONTEXT = Rule(integer=True, lo=16, hi=2**16)   # room for the sample's prompt and some story after it
MIN_RATE = Rule(lo=0, hi=10)
CLIP = Rule(above=0, hi=1e6)                     # a norm to clip to: 0 would be no step at all
# Counts whose every unit is memory held at once: the batch, the validation windows, the stories written (a
# story's tokens are held as a list until the last is written, a student's teacher stories as (2, context) int32
# rows: 10^5 stories of a 256-token context hold about 1 GB, 10^6 would hold about 9).
BATCH, BATCHES, STORIES = (Rule(integer=True, lo=1, hi=hi) for hi in (2**16, 10**4, 10**5))
SAMPLING_TEMPERATURE = Rule(lo=0.01, hi=100)  # a temperature one samples at (0 is greedy: the default labels)
LAYER_ID = Rule(integer=True, lo=0, hi=1024)     # a target block, 0-indexed (its output); the target bounds it further
layer_ids = number_list(LAYER_ID)  # '1,2,4' -> [1, 2, 4]


def setting(default, help: str, group: str = "", **argparse_options):
    """A RunConfig field: its default, its --help text, its group in --help, argparse's type/choices."""
    return field(default=default, metadata={"help": help, "group": group, **argparse_options})


@dataclass(frozen=True)
class RunConfig:
    model: str = setting("mdlm", "what to train: mdlm, the masked-diffusion LM; ar, the AR model; mdlm-moe, "
                         "the diffusion LM with experts; ar-moe, the AR model with experts; dflash or eagle3, a "
                         "drafter for --target", choices=KINDS)
    preset: str | None = setting(None, "model size (default: 13m on CUDA, tiny on CPU)", choices=sorted(PRESETS))
    context: int | None = setting(None, "override the preset's context length (tokens per window)", type=CONTEXT)
    data: str | None = setting(None, "TinyStories-train.txt-format file (default: download from Hugging Face)")
    max_steps: int | None = setting(None, "optimizer steps (default: 30000 for a 13m model, else 5000)", type=COUNT)
    batch_size: int | None = setting(None, "windows per step (default: 64 for a 13m model, else 32)", type=BATCH)
    lr: float = setting(3e-3, "peak learning rate", type=RATE)
    min_lr: float | None = setting(None, "final learning rate of the cosine (default lr / 10)", type=MIN_RATE)
    warmup: int = setting(100, "linear warmup steps (0: none)", type=COUNT_OR_NONE)
    weight_decay: float = setting(0.1, "AdamW weight decay on matrices", type=WEIGHT)
    grad_clip: float = setting(1.0, "clip the gradient norm to this", type=CLIP)
    seed: int = setting(1337, "seeds initialisation and the data order", type=SEED)
    eval_every: int = setting(250, "validate every N steps", type=COUNT)
    eval_batches: int = setting(8, "validation batches", type=BATCHES)
    init: str | None = setting(None, "start from this checkpoint's weights (a new run: fresh optimizer and schedule)")
    noise_block: int | None = setting(None, "mdlm, mdlm-moe: a noise level per block of N tokens behind a clean "
                                      "prefix (block diffusion, what the cached block sampler meets; default: one "
                                      "per window)", type=COUNT_OR_NONE)
    target: str | None = setting(None, "the target checkpoint the draft or drafter learns to draft for: ar or "
                                 "ar-moe; for --model ar also a diffusion LM (mdlm, mdlm-moe), whose left-to-right "
                                 "sampler writes the --regenerate stories", "drafter")
    block_size: int = setting(16, "B: the drafter fills B-1 slots per forward", "drafter", type=BLOCK)
    regenerate: int | None = setting(None, "train on N stories --target writes from story openings", "drafter",
                                     type=STORIES)
    openings: str = setting("corpus", "--regenerate's story openings: the corpus's, or sampled by the target",
                            "drafter", choices=("corpus", "target"))
    draft_temperature: float | None = setting(None, "train for sampling at this temperature: --regenerate's "
                                              "stories are sampled at it and the labels are an AR target's "
                                              "distribution at it (a diffusion target's: its stories; default: "
                                              "greedy stories, hard labels)",
                                              "drafter", type=SAMPLING_TEMPERATURE)
    target_layers: int | None = setting(None, "ar with --target: the draft starts as the target's first N layers, "
                                        "its embedding, final norm and head (LayerSkip's early exit), and trains "
                                        "from there (default: fresh from --preset)", "drafter", type=DEPTH)
    steps_ahead: int = setting(3, "eagle3: training unrolls the head K steps", "drafter", type=DEPTH)
    drafter_layers: int | None = setting(None, "dflash: the drafter's own Transformer layers (default 1)", "drafter",
                                         type=DEPTH)
    markov_rank: int | None = setting(None, "dflash: rank of DSpark's Markov head, a bias on each slot's logits "
                                      "from the token drafted before it (default 0: none)", "drafter",
                                      type=COUNT_OR_NONE)
    feature_layers: list[int] | None = setting(None, "dflash: target blocks whose outputs to read (0-indexed, the "
                                               "paper's ids), e.g. 1,2,4 (default: the paper's rule, "
                                               "N = min(5, L-3))", "drafter", type=layer_ids)
    distill: str | None = setting(None, "train a student, from this diffusion LM's weights, on the stories it "
                                  "writes one token per step, to be sure of several tokens per forward", "distill",
                                  metavar="TEACHER_CKPT")
    distill_stories: int | None = setting(None, "stories the teacher writes (default 1000)", "distill", type=STORIES)
    certainty_weight: float | None = setting(None, "beta of dParallel's certainty term (default 2; 0 = plain "
                                             "masked cross-entropy)", "distill", type=WEIGHT)
    teacher_temperature: float | None = setting(None, "the teacher writes at this temperature (default 1, the "
                                                "quality tool's; 0: greedy, dParallel's)", "distill", type=TEMPERATURE)
    teacher_order: str | None = setting(None, "the order the teacher reveals positions in (default "
                                        "low_confidence, its standard schedule; random: MDLM's own sampler)",
                                        "distill", choices=REMASKING)
    distill_loss: str | None = setting(None, "certainty (dParallel, default) or tad (far positions learn the "
                                       "teacher's distribution)", "distill", choices=DISTILL_LOSSES)
    anchor_weight: float | None = setting(None, "add this times the model's own loss on corpus windows to each "
                                          "step, to keep the student a model of the corpus (default 0: none)",
                                          "distill", type=WEIGHT)
    experts: int | None = setting(None, "routed experts per layer (default 32)", "moe", type=EXPERTS)
    top_k: int | None = setting(None, "routed experts per token (default 3)", "moe", type=EXPERTS)
    routing: str = setting("token", "expert routing", "moe", choices=("token", "block"))
    route_threshold: float = setting(0.6, "block routing: coreset mass", "moe", type=MASS)
    route_guard: int = setting(4, "block routing: at least this many experts", "moe", type=EXPERTS)
    qat: str | None = setting(None, "fine-tune with the experts fake-quantized in this FP4 format (straight-"
                              "through gradient; python -m tinydiff.tools.quantize then packs them), e.g. with --init "
                              "a full-precision checkpoint", "moe", choices=FP4_FORMATS)
    route_mask_vote: float = setting(1.0, "block routing: a MASK token's vote in its block's coreset, against a "
                                     "committed token's 1 (1 is the paper's rule)", "moe", type=POSITIVE)

    def __post_init__(self):  # the flags' rules again, for settings read back from a checkpoint
        for f in fields(self):
            value, rule = getattr(self, f.name), f.metadata.get("type")
            if value is not None and isinstance(rule, Rule):
                rule.check(flag(f.name), value)
            if value is not None and "choices" in f.metadata and value not in f.metadata["choices"]:
                raise UserError(f"{flag(f.name)} must be one of {', '.join(f.metadata['choices'])}, got {value!r}")
        if self.feature_layers is not None:
            for i in self.feature_layers:
                LAYER_ID.check("--feature-layers id", i)
        if not self.distill and any(getattr(self, key) is not None for key in DISTILL_TUNING):
            raise UserError(f"{', '.join(flag(key) for key in DISTILL_TUNING)} tune --distill TEACHER_CKPT: add it")
        if self.draft_temperature is not None and not (self.target and self.model in ("ar", *DRAFTERS)):
            raise UserError("--draft-temperature trains a draft or drafter for sampling from its --target: use "
                            "--model ar, dflash or eagle3 with --target CKPT")
        if self.target_layers is not None and not (self.target and self.model == "ar"):
            raise UserError("--target-layers starts an AR draft from its --target's first layers: use --model ar "
                            "with --target CKPT")
        if self.target_layers is not None and (self.init or self.distill):
            raise UserError("--target-layers builds a new draft from --target's layers: drop --init and --distill")
        if self.openings == "target" and not self.regenerate:
            raise UserError("--openings picks where --regenerate's stories start: add --regenerate N")


SETTINGS = tuple(f.name for f in fields(RunConfig))


def add_flags(parser: argparse.ArgumentParser):
    """One flag per RunConfig field, each defaulting to None (unset: the run or the checkpoint decides),
    its help naming the field's default."""
    groups = {"": parser, **{key: parser.add_argument_group(title) for key, title in GROUPS.items()}}
    for f in fields(RunConfig):
        options = {k: v for k, v in f.metadata.items() if k not in ("help", "group")}
        text = f.metadata["help"]
        if f.default is not None and "default" not in text:
            text += f" (default {f.default})"
        groups[f.metadata["group"]].add_argument(flag(f.name), help=text, **options)


def given_settings(args: argparse.Namespace) -> dict:
    """The run settings the command line set (flags left unset are absent)."""
    return {key: getattr(args, key) for key in SETTINGS if getattr(args, key) is not None}


def new_run(args: argparse.Namespace, preset: str) -> dict:
    """A new run's settings: the flags given, every other field's default; `preset` when none is given
    (none at all where the model's shape comes from --init, --distill, or a drafter's or --target-layers'
    --target)."""
    run = RunConfig(**given_settings(args))
    run = asdict(run)
    borrowed = run["init"] or run["distill"] or run["target_layers"] or run["model"] in DRAFTERS  # another's shape
    run["preset"] = None if borrowed else run["preset"] or preset
    run["min_lr"] = run["lr"] / 10 if run["min_lr"] is None else run["min_lr"]
    for key, value in RUN_LENGTH.get(run["preset"], RUN_LENGTH[None]).items():
        run[key] = value if run[key] is None else run[key]
    return run


def migrate(stored: dict, path) -> dict:
    """A checkpoint's run settings, complete: keys older checkpoints lack get their field's default
    (what those runs did), and settings this code does not know are an error."""
    unknown = sorted(set(stored) - set(SETTINGS))
    if unknown:
        raise UserError(f"{path} holds run settings this code does not know ({', '.join(unknown)}); it was "
                        "written by another version of tinydiff")
    defaults = {f.name: f.default for f in fields(RunConfig) if f.default is not MISSING}
    return asdict(RunConfig(**{**defaults, **RUN_LENGTH[None], **stored}))  # the length every run had then


def run_settings(args):
    """(run settings, run folder, checkpoint or None): a resumed run's from its checkpoint, a new
    run's from the flags; a new run never overwrites a checkpoint."""
    check_device(args.device)
    out = Path(args.out) if args.out else None
    if args.resume:
        if out is None:
            raise UserError("--resume needs --out, the folder of the run to continue")
        check_run_folder(out)
        ckpt = load_checkpoint(out / "ckpt.pt")
        if not all(key in ckpt for key in ("optimizer", "args", "step", "rng")):
            raise UserError(f"{out / 'ckpt.pt'} holds weights but no training state, so it cannot be resumed")
        return resumed_settings(args, ckpt, out / "ckpt.pt"), out, ckpt
    run = defaults(args, args.device)
    name = run["preset"] or ("distilled" if run["distill"] else "init" if run["init"] else
                             f"exit{run['target_layers']}" if run["target_layers"] else default_preset(args.device))
    out = out or Path("out") / f"{run['model']}-{name}"
    check_run_folder(out)
    check_new(out)
    return run, out, None


def check_new(out: Path):
    if (out / "ckpt.pt").exists():
        raise UserError(f"{out / 'ckpt.pt'} exists; pass --resume to continue it, or another --out")


def default_preset(device: str) -> str:
    return "13m" if device.startswith("cuda") else "tiny"


def defaults(args, device: str) -> dict:
    """A new run's settings: the flags given, RunConfig's defaults for the rest."""
    run = new_run(args, default_preset(device))
    if args.preset is None and run["preset"] == "tiny" and not device.startswith("cuda"):
        print("notice: no GPU, so training the 'tiny' preset (pass --preset 13m to train the full model on CPU)")
    given = [flag(key) for key in STUDENT_SHAPE if getattr(args, key) is not None]
    if run["distill"] and given:
        raise UserError(f"a student has its teacher's shape and objective: drop {', '.join(given)}")
    given = [flag(key) for key in ("preset", "context") if getattr(args, key) is not None]
    if run["init"] and not run["distill"] and given:
        raise UserError(f"--init {run['init']} continues that model, in its shape: drop {', '.join(given)}")
    if run["target_layers"] and given:
        raise UserError(f"--target-layers takes the draft's shape from --target: drop {', '.join(given)}")
    if run["model"] in DRAFTERS and given:
        raise UserError(f"a {run['model']} drafter takes its dimensions from --target: drop {', '.join(given)}")
    return run


def same_data(ckpt, digest: str, path) -> str:
    """The sha256 of the run's token files (`digest`); a resumed run's must be the one its checkpoint recorded."""
    if ckpt is not None:
        stored = ckpt.get("data", {}).get("tokens")
        if stored is None:
            print(f"notice: {path} was written before runs recorded their data, so whether --data is the same "
                  "cannot be checked")
        elif stored != digest:
            raise UserError(f"this data (tokens sha256 {digest[:12]}) is not the data the run in {path} started "
                            f"with ({stored[:12]}); resume with the same --data, or start a new run with another --out")
    return digest


def resumed_settings(args, ckpt: dict, path) -> dict:
    """The checkpoint's run settings; a flag that contradicts them is an error, not a silent change."""
    run = migrate(ckpt["args"], path)
    for key, given in given_settings(args).items():
        if given != run[key]:
            raise UserError(f"{flag(key)} {given} differs from the run in {path} "
                            f"({run[key]}); drop the flag to resume, or start a new run with another --out")
    return run
