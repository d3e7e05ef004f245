"""What the benchmark tools share: the fixed prompts or held-out story openings, the models they time
(trained checkpoints, or untrained stand-ins that time the same work), one method's totals over
the prompts (`measure`; several methods prompt by prompt in turn: `measure_interleaved`), held-out
NLL and bits per byte, and the device's name for the tables.
"""
import platform
import subprocess
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from tinydiff.ar import elapsed, split_time
from tinydiff.bench.methods import FR_ROWS, MEANS
from tinydiff.data import eval_windows, load_tokens
from tinydiff.dflash import DFlashConfig, DFlashDrafter
from tinydiff.dmoe import MoETransformer, moe_config, set_routing
from tinydiff.eagle3 import EagleConfig, EagleHead
from tinydiff.extras.markov_head import drafter_from
from tinydiff.extras.regenerate import story_openings
from tinydiff.fast.compiled import compile_seconds
from tinydiff.fast.frequent_vocab import FrequentVocabDraft, frequent_ids
from tinydiff.io.checkpoint import AR_KINDS, head_from, load_checkpoint, load_model
from tinydiff.io.tokens import prepare_tokens
from tinydiff.model import Transformer, preset
from tinydiff.speculative import acceptance_by_slot
from tinydiff.tools.eval import score

PROMPTS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tom and his dog went to the park.",
    "One day, a big bear found a red ball in the forest.",
    "Sam wanted to help his mom in the kitchen.",
]
OPENING = 8  # tokens of each held-out story opening: regenerate.py's openings are this long too


def heldout_openings(data: str, n: int, seed: int) -> list[list[int]]:
    """n story openings of OPENING tokens from the validation split of the file `data`."""
    return story_openings(load_tokens(prepare_tokens(data)[1]), n, OPENING, seed)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:  # Linux names the CPU model here; platform only knows the architecture
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    threads = torch.get_num_threads()
    return f"{cpu} CPU, {threads} thread{'s' * (threads != 1)}"


def git_commit() -> str:
    """HEAD's short hash, marked when tracked files differ from it; "unknown" outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "diff", "HEAD", "--quiet"], cwd=root, capture_output=True)
    except OSError:  # no git installed
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.returncode else "")


def measure(method, models, prompts, args) -> dict:
    """Sum a method's counts over all prompts (after an untimed warm-up): its row of the table.

    Every method reports new_tokens, seconds and target_forwards; speculative ones also an
    accepted-count histogram, the drafts proposed and, for chains, the rounds that rejected one,
    from which alpha (accepted / judged) follows.
    """
    return measure_interleaved([(method, models)], prompts, args)[0]


def measure_interleaved(runs, prompts, args) -> list[dict]:
    """measure() for several (method, models) at once, prompt by prompt: each prompt is decoded by
    every method before the next, so a slow phase of a shared machine falls on them all alike.

    Each warm-up runs prompts until one compiles nothing new (at most 8): a compiled shape met only
    later (a round that accepts every draft, say) would compile inside the timed prompts. Should that
    still happen, its compile time is taken out of the decoding time (it is reported apart).
    """
    timed = [Timed(method, models, args) for method, models in runs]
    for run in timed:
        run.warm_up(prompts)
    for prompt in tqdm(prompts, desc="bench, methods in turn", unit="prompt", file=sys.stderr, disable=len(timed) == 1):
        for run in timed:
            run.add(prompt)
    return [summarise(run.totals_after_compiles(), len(prompts)) for run in timed]


class Timed:
    """One method's timed run: its generator (reseeded per prompt), its totals, the compile seconds
    its models had spent when the warm-up ended."""

    def __init__(self, method, models, args):
        self.method, self.models, self.args = method, models, args
        self.generator = torch.Generator(args.device).manual_seed(args.seed)
        self.totals = {}

    def compiled(self, roles=None) -> float:
        return compile_seconds(self.models.values() if roles is None else [self.models.get(r) for r in roles])

    def warm_up(self, prompts):
        for prompt in prompts[:8]:
            before = self.compiled()
            self.method(self.models, prompt, self.args, self.generator)
            if self.compiled() == before:
                break
        self.warmed, self.warmed_target = self.compiled(), self.compiled(["target"])

    def add(self, prompt):
        self.generator.manual_seed(self.args.seed)
        for key, value in self.method(self.models, prompt, self.args, self.generator).items():
            if isinstance(value, list):
                self.totals[key] = [a + b for a, b in zip(self.totals.get(key, [0] * len(value)), value)]
            else:
                self.totals[key] = self.totals.get(key, 0) + value

    def totals_after_compiles(self) -> dict:
        """The totals with what still compiled in the timed prompts taken out of the phase that paid it."""
        totals = dict(self.totals)
        late = self.compiled() - self.warmed
        totals["seconds"] -= late
        if "draft_seconds" in totals:  # the target compiles in the verify, the rest in the draft
            late_target = self.compiled(["target"]) - self.warmed_target
            totals["verify_seconds"] -= late_target
            totals["draft_seconds"] -= late - late_target
        return totals


def summarise(totals: dict, n_prompts: int) -> dict:
    """A method's row from its totals over n_prompts prompts."""
    row = {"tokens_per_s": totals["new_tokens"] / totals["seconds"],
           "target_forwards_per_token": totals["target_forwards"] / totals["new_tokens"],
           "tau": totals["new_tokens"] / totals["target_forwards"]}
    row.update({key: totals[key] / n_prompts for key in MEANS if key in totals})
    if "canvases" in totals:  # a batched forward's cost on a CPU (self_speculative.py)
        row["canvases_per_token"] = totals["canvases"] / totals["new_tokens"]
    if "nodes" in totals:  # a tree's verify cost: nodes per round (alpha is not defined for trees)
        row["nodes_per_round"] = totals["nodes"] / totals["rounds"]
    if "hits" in totals:
        row["hit_rate"] = sum(totals["hits"]) / max(1, sum(totals["lookups"]))
        row["modelled_speedup_vs_spec"] = totals["modelled_seconds_sd"] / totals["modelled_seconds_ssd"]
    if "draft_seconds" in totals:  # the loop's own costs, for Leviathan's formula with real prices
        row["seconds_per_draft"] = totals["draft_seconds"] / totals.get("proposed", totals.get("nodes"))
        row["seconds_per_verify"] = totals["verify_seconds"] / totals["target_forwards"]
    if "accepted" in totals:  # per round: the stages the loop clocked (drafting and verifying, or a fused
        # round's graph call to its read-back), then the loop's own work around them; unclocked, the whole round
        stages = {part: totals[f"{part}_seconds"] for part in ("draft", "verify", "graph")
                  if f"{part}_seconds" in totals}
        rounds = sum(totals["accepted"])
        row["us_per_round"] = {part: 1e6 * seconds / rounds for part, seconds in stages.items()}
        row["us_per_round"]["host" if stages else "in all"] = 1e6 * (totals["seconds"] - sum(stages.values())) / rounds
        row["accepted_hist"] = totals["accepted"]
        accepted = sum(n * count for n, count in enumerate(totals["accepted"]))
        judged = accepted + totals.get("rejected", 0)
        row["alpha"] = accepted / judged if "rejected" in totals and judged else None
        row["slot_judged"], row["slot_kept"] = totals["slot_judged"], totals["slot_kept"]
        row["acceptance_by_slot"] = acceptance_by_slot(row["slot_kept"], row["slot_judged"])
    return row


def load_models(args) -> dict:
    models = {}
    for name, path, kind, size in (("target", args.ckpt, "ar", "tiny"), ("draft", args.draft, "ar", "draft"),
                                   ("mdlm", args.mdlm, "mdlm", "tiny"), ("distilled", args.distilled, "mdlm", "tiny"),
                                   ("distilled_draft", args.distilled_draft, "ar", "draft")):
        if path:  # the target may be an ar-moe (float or FP4 experts): the AR rows decode it as they do a dense one
            models[name], _ = load_model(path, args.device, kinds=AR_KINDS if name == "target" else (kind,))
        else:
            print(f"notice: no checkpoint for the {name} model, timing an untrained '{size}' one "
                  "(speeds are real, text is not)", file=sys.stderr)
            torch.manual_seed(args.seed)
            models[name] = Transformer(preset(size, causal=kind == "ar")).to(args.device).eval()
    if FR_ROWS.intersection(m.strip() for m in args.methods.split(",")):  # FR-Spec: counted on the training split
        ids = frequent_ids(load_tokens(prepare_tokens(args.data)[0]), args.draft_vocab)
        models["draft_fr"] = FrequentVocabDraft(models["draft"], ids)
    if args.drafter:
        models["drafter"] = drafter_from(load_checkpoint(args.drafter), models["target"], args.drafter)
    else:
        print("notice: no --drafter, timing an untrained DFlash drafter", file=sys.stderr)
        models["drafter"] = DFlashDrafter(DFlashConfig.for_target(models["target"].config), models["target"])
    if args.eagle:
        models["eagle"] = head_from(load_checkpoint(args.eagle), models["target"], args.eagle)
    else:
        print("notice: no --eagle, timing an untrained EAGLE-3 head", file=sys.stderr)
        models["eagle"] = EagleHead(EagleConfig.for_target(models["target"].config), models["target"])
    if args.moe:
        models["moe"], _ = load_model(args.moe, args.device, kinds=("mdlm-moe",))
    else:
        print("notice: no checkpoint for the moe model, timing an untrained one", file=sys.stderr)
        models["moe"] = MoETransformer(moe_config("tiny")).to(args.device).eval()
    return models


@torch.no_grad()
def heldout_nll(models, args, tokenizer, wanted) -> dict:
    """(nats/token, bits/byte) on 16 windows of --data's validation split, for each `wanted` model
    ("target", "mdlm", "distilled", "moe-token", "moe-block"): exact for the AR model, the ELBO bound (4 noise
    draws; block diffusion's for a model trained with --noise-block) for the diffusion LMs, the MoE
    one under each routing."""
    _, val_path = prepare_tokens(args.data)
    out = {}
    scored_models = [(name, models["moe"] if name.startswith("moe-") else models[name]) for name in wanted]
    for name, model in scored_models:
        if name.startswith("moe-"):
            set_routing(model, name[len("moe-"):])
        windows = eval_windows(load_tokens(val_path), 16, model.config.context).to(args.device)
        scored = score(model, "ar" if name == "target" else "mdlm", windows, mc=4, batch_size=len(windows),
                       tokenizer=tokenizer)  # one batch: the 16 windows share the noise draws
        out[name] = (scored["nll"], scored["bits_per_byte"])
    return out


def per_call_us(fn, calls: int, device) -> float:
    """Microseconds per call of fn over `calls` back-to-back calls (after 3 untimed ones), the GPU waited for
    at both ends: on CUDA the host's time per call where it is slower than the device, else the device's."""
    for _ in range(3):
        fn()
    start = split_time(device)
    for _ in range(calls):
        fn()
    return 1e6 * elapsed(start, device) / calls

def device_us(fn, calls: int) -> float:
    """Microseconds of the device's own time per call of fn (CUDA events around `calls` calls)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * begin.elapsed_time(end) / calls
