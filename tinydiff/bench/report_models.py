"""The report's models (`python -m tinydiff.bench --report DIR`, report.py): which the report trains, with
which train.py flags, and whether each is given, to train, to resume or to reuse.

Each role (target, draft, DFlash drafter, EAGLE-3 head, diffusion LM, MoE) comes from its bench flag when
given (checked for its kind before any training), else from out/report-PRESET/ROLE/ckpt.pt, trained by
train.py in this process when missing, resumed when interrupted, reused when finished with this preset's
settings (another run's settings are an error). The drafters learn the target's own text (--regenerate),
written once and copied to each drafter's folder. Training's own bars advance the report's one bar.
Leaves out: training in parallel, several seeds.
"""
import importlib.util
import shutil
import sys
from contextlib import redirect_stdout
from pathlib import Path

from tinydiff.checks import UserError
from tinydiff.extras import regenerate
from tinydiff.io import progress
from tinydiff.io.checkpoint import load_checkpoint
from tinydiff.train.run_config import SETTINGS

# role -> (the bench flag that names its checkpoint, the checkpoint kind it must hold). Dict order
# is training order: the draft, the drafters and the diffusion LM all start from the target.
ROLES = {"target": ("ckpt", "ar"), "draft": ("draft", "ar"), "drafter": ("drafter", "dflash"),
         "eagle": ("eagle", "eagle3"), "mdlm": ("mdlm", "mdlm"), "moe": ("moe", "mdlm-moe")}

# name -> model preset (and context), stories the target writes for its drafters, (steps, batch) per role
REPORT_PRESETS = {
    # a pipeline check in about a minute on a CPU; the numbers mean nothing
    "smoke": {"preset": "draft", "context": 128, "regenerate": 8, "runs": {role: (2, 2) for role in ROLES}},
    # sized for under 30 minutes of training and measuring on a 2-core CPU
    "tiny": {"preset": "tiny", "regenerate": 100, "runs": {"target": (300, 8), "draft": (200, 8),
             "drafter": (100, 4), "eagle": (50, 4), "mdlm": (150, 8), "moe": (100, 8)}},
    # for a GPU (train.py's defaults for the target); not yet timed
    "13m": {"preset": "13m", "regenerate": 1000, "runs": {"target": (5000, 32), "draft": (2000, 32),
            "drafter": (2000, 16), "eagle": (2000, 16), "mdlm": (5000, 32), "moe": (5000, 32)}},
}


def role_flags(role: str, plan: dict, target: str) -> list[str]:
    """What train.py is told to train for `role` (the target's checkpoint path given)."""
    P, R = plan["preset"], str(plan["regenerate"])
    C = ["--context", str(plan["context"])] if "context" in plan else []  # the others inherit the target's
    return {"target": ["--model", "ar", "--preset", P, *C],
            "draft": ["--model", "ar", "--preset", "draft", "--target", target, "--regenerate", R, *C],
            "drafter": ["--model", "dflash", "--target", target, "--regenerate", R, "--block-size", "16"],
            "eagle": ["--model", "eagle3", "--target", target, "--regenerate", R],
            # a lower peak rate than from scratch: the AR weights are a start worth keeping
            "mdlm": ["--model", "mdlm", "--init", target, "--lr", "1e-3"],  # the target's shape
            "moe": ["--model", "mdlm-moe", "--preset", P, *C]}[role]


def train_argv(role: str, plan: dict, target: str, folder: Path, args) -> list[str]:
    steps, batch = plan["runs"][role]
    return [*role_flags(role, plan, target), "--out", str(folder), "--max-steps", str(steps),
            "--batch-size", str(batch), "--warmup", str(max(1, steps // 10)), "--eval-every", str(steps),
            "--eval-batches", "2", "--ckpt-every", "50", "--seed", str(args.seed), "--device", args.device,
            *(["--data", args.data] if args.data else [])]


def plan_models(args, plan: dict, root: Path) -> dict:
    """role -> {"path", "argv" (None: given, nothing to train), "todo" (steps left to train), "kind", "step"}."""
    plans, target = {}, args.ckpt or str(root / "target" / "ckpt.pt")
    for role, (flag, kind) in ROLES.items():
        given = getattr(args, flag)
        if given:  # checked now, not after half an hour of training the others
            ckpt = load_checkpoint(given)
            if ckpt.get("kind") != kind:
                raise UserError(f"--{flag} {given} holds a {ckpt.get('kind')!r} model; the {role} must be a "
                                f"{kind!r} checkpoint")
            plans[role] = {"path": given, "argv": None, "todo": 0, "kind": kind, "step": ckpt.get("step", 0)}
            continue
        folder = root / role
        argv = train_argv(role, plan, target, folder, args)
        plans[role] = {"path": str(folder / "ckpt.pt"), "argv": argv, "todo": steps_left(folder / "ckpt.pt", argv),
                       "kind": kind, "step": plan["runs"][role][0]}
    return plans


def train_program():
    """train.py, the repository's training program, as a module: the report runs it in this process,
    so that its bars route to the report's (tinydiff.io.progress)."""
    if "train" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train", Path(__file__).resolve().parents[2] / "train.py")
        sys.modules["train"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["train"])
    return sys.modules["train"]


def steps_left(path: Path, argv: list[str]) -> int:
    """Training steps still to run for `argv`; an existing run trained otherwise is an error."""
    wanted = vars(train_program().parse_args(argv))
    if not path.exists():
        return wanted["max_steps"]
    ckpt = load_checkpoint(path)
    run = ckpt.get("args") or {}
    differ = [key for key in SETTINGS if wanted[key] is not None and wanted[key] != run.get(key)]
    if differ:
        raise UserError(f"{path} was trained with other settings ({', '.join(differ)}) than this report "
                        f"uses; delete {path.parent} to retrain it, or pass it with its bench flag")
    return max(0, run["max_steps"] - ckpt["step"])


def stand_in_bar(bar, stage: str):
    """A stand-in for the library's tqdm bars (tinydiff.io.progress) while a model trains: their steps
    advance the report's one bar (one ETA for the whole run); their lines go to stdout, the stage's log."""

    class Inner:
        def __init__(self, iterable=None, desc="", **_):  # total, initial: in the report's total already
            self.iterable, self.desc = iterable, desc

        def __iter__(self):
            for item in self.iterable:
                yield item
                bar.update(1)

        def update(self, n=1):
            bar.update(n)

        def set_postfix_str(self, text):
            bar.set_postfix_str(f"{self.desc}: {text}")

        write, close = staticmethod(print), staticmethod(lambda: None)

    bar.set_description(stage)
    return Inner


def train_missing(plans: dict, bar):
    text = None  # the folder whose stories the target regenerated in this run; the drafters all use them
    for role, job in plans.items():
        if job["argv"] is None:
            continue
        path = Path(job["path"])
        if job["todo"] == 0:
            bar.write(f"{role}: reusing {path}")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            for name in regenerate.FILES if "--regenerate" in job["argv"] and text else ():
                if not (path.parent / name).exists():  # the same target, openings, count and seed: the same stories
                    shutil.copyfile(text / name, path.parent / name)
            argv = job["argv"] + (["--resume"] if path.exists() else [])
            bar.write(f"{role}: training {path} (log: {path.parent / 'train.log'})")
            Inner = stand_in_bar(bar, f"train {role}")
            with open(path.parent / "train.log", "a") as log, redirect_stdout(log), progress.routed_to(Inner):
                train_program().main(argv)
            if steps_left(path, job["argv"]) > 0:  # train.py saves and returns on Ctrl-C
                raise UserError(f"interrupted while training {path}; run the same command again to continue")
        if "--regenerate" in job["argv"] and all((path.parent / name).exists() for name in regenerate.FILES):
            text = path.parent


def regenerations(plans: dict, plan: dict) -> int:
    """Stories the target will write in this run: none when a drafter's folder has them already."""
    jobs = [job for job in plans.values() if job["argv"] and "--regenerate" in job["argv"]]
    found = [all((Path(job["path"]).parent / name).exists() for name in regenerate.FILES) for job in jobs]
    n = plan["regenerate"]
    return 0 if any(found) or not any(job["todo"] for job in jobs) else n + regenerate.validation_stories(n)
