"""Self-distillation for parallel decoding: dParallel's certainty-forcing distillation (Chen et al.
2025), with TAD's near/far variant (Temporal-Aware Distillation) beside it.

A diffusion LM trained on the ELBO is sure only of the position right after the committed text, so
committing several tokens per forward commits guesses. Distillation on the model's own decoding
trajectories teaches it to be sure of many positions at once.
  1. Teacher: a trained diffusion LM, frozen, writes stories with its standard schedule: the cached
     semi-AR sampler (sampler.generate_cached), one token per step, low-confidence order, from
     EOT + the first 0..max_opening tokens of corpus stories, 4 blocks each. For every position it
     records the step of its block at which the teacher revealed it: `write_trajectories`. Another
     order may be chosen (`order`): "random" is MDLM's own sampler, whose samples are the model's
     distribution and not the mode a low-confidence order seeks.
  2. States (d3LLM's form of dParallel's): pick a block; the blocks before it are the teacher's
     final tokens, the blocks after it are MASK, and inside it the first r positions of the
     teacher's reveal order are revealed (r uniform in 0..N-1). That is exactly the teacher's own
     canvas after r steps of that block: `state`.
  3. Loss, on the masked positions of the block: cross-entropy to the teacher's final tokens (a
     plain mean, no 1/t weight) + beta * the mean entropy of softmax(z / 0.5) over the positions
     whose argmax already is the teacher's token (certainty forcing; beta = 2). beta = 0 is plain
     masked CE. TAD's variant replaces the CE of positions the teacher revealed more than
     `tad_horizon` steps later by KL(teacher || student) at temperature 1.
  4. Anchor (not in dParallel, off by default): anchor_weight * the teacher's own training loss on
     corpus windows, added to every training step. Trajectories alone teach the student the
     teacher's few hundred stories; the anchor keeps it a model of the corpus.
One forward covers every block of a story (as block diffusion's loss does): the model reads
[the clean story; one group per block holding that block's state], with a mask that gives each
row exactly the keys the cached sampler gives it (`state_mask`), so the student trains on the
very logits it will decode with. A shifted (AR-adapted) model reads position lo at output lo - 1,
so its groups start one token early, with the finished token before the block.
Leaves out: dParallel's second pass on the complementary mask, d3LLM's curriculum over mask ratios,
distilling a sampler with self-correction.
"""
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from tinydiff.checks import UserError
from tinydiff.data import sample_windows
from tinydiff.diffusion import subs_logits
from tinydiff.dmoe import balance_loss
from tinydiff.extras.regenerate import story_openings
from tinydiff.io import progress
from tinydiff.io.checkpoint import DIFFUSION_KINDS, config_from, load_checkpoint, load_model, model_from
from tinydiff.io.files import stamp_holds, write_stamped
from tinydiff.model import wide
from tinydiff.sampler import REMASKING, generate_cached
from tinydiff.tokenizer import EOT, MASK

PAD, PROMPT = -2, -1  # the step recorded for a pad (before a short prompt) and for a prompt position
LOSSES = ("certainty", "tad")


@dataclass
class DistillConfig:
    stories: int = 1000                 # stories the teacher writes to train on
    block_length: int = 32              # the teacher's decoding block, and the student's
    blocks: int = 4                     # blocks per story, or fewer if the context holds fewer (0: all it holds)
    max_opening: int = 8                # a story starts from EOT + 0..max_opening corpus tokens
    temperature: float = 1.0            # the teacher's sampling temperature (the quality tool's)
    order: str = "low_confidence"       # the teacher's remasking rule; "random" is MDLM's own any-order sampler
    certainty_weight: float = 2.0       # beta: weight of the entropy on positions already right
    certainty_temperature: float = 0.5  # that entropy is of softmax(logits / this)
    loss: str = "certainty"             # "certainty" (dParallel) or "tad" (hard CE near, KL far)
    tad_horizon: int = 8                # tad: positions revealed within this many steps get hard CE
    anchor_weight: float = 0.0          # weight of the model's own loss on corpus windows (0: none)

    def __post_init__(self):
        if min(self.stories, self.block_length, self.tad_horizon) < 1 or min(self.max_opening, self.blocks) < 0:
            raise UserError(f"--distill-stories must be >= 1, got {self.stories} (and a block length >= 1, blocks "
                            f"and max opening >= 0, a TAD horizon >= 1: {self.block_length}, {self.blocks}, "
                            f"{self.max_opening}, {self.tad_horizon})")
        for name in ("temperature", "certainty_weight", "certainty_temperature", "anchor_weight"):
            value = getattr(self, name)
            if not 0 <= value < float("inf") or (name == "certainty_temperature" and value == 0):
                flag = {"temperature": "teacher-temperature"}.get(name, name.replace("_", "-"))
                raise UserError(f"--{flag} must be a finite number >= 0"
                                f"{' (and > 0)' if name == 'certainty_temperature' else ''}, got {value}")
        if self.order not in REMASKING:
            raise UserError(f"--teacher-order must be one of {', '.join(REMASKING)}, got {self.order!r}")
        if self.loss not in LOSSES:
            raise UserError(f"--distill-loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")


ROUTING_FIELDS = ("routing", "route_threshold", "route_guard", "route_mask_vote")  # not shape: flags may set them


def load_teacher(path, kind: str, device="cpu"):
    """The frozen teacher: a diffusion LM (it writes by denoising) of the run's kind."""
    teacher, ckpt = load_model(path, device)
    if ckpt["kind"] not in DIFFUSION_KINDS:
        raise UserError(f"--distill {path} holds a {ckpt['kind']} model; the teacher must be a diffusion LM "
                        "(mdlm or mdlm-moe)")
    if ckpt["kind"] != kind:
        raise UserError(f"--distill {path} holds a {ckpt['kind']} model; pass --model {ckpt['kind']} to distil it")
    return teacher.requires_grad_(False), ckpt


def student_from(teacher_path, kind: str, init=None, device="cpu"):
    """The student's start: the teacher's weights, or --init's, which must have the teacher's shape."""
    _, teacher = load_teacher(teacher_path, kind)
    start = teacher if init is None else load_checkpoint(init)
    # configs as the classes read them: a field one file predates counts as its default, not as a difference
    shape, theirs = ({key: value for key, value in asdict(config_from(ckpt, path)).items() if key not in ROUTING_FIELDS}
                     for ckpt, path in ((teacher, teacher_path), (start, init or teacher_path)))
    if start["kind"] != teacher["kind"] or theirs != shape:
        differ = sorted(k for k in shape.keys() | theirs.keys() if shape.get(k) != theirs.get(k)) or ["kind"]
        raise UserError(f"--init {init} does not fit the teacher {teacher_path} (it differs in {', '.join(differ)}); "
                        "a student has its teacher's shape: drop --init or pass a student of this teacher")
    return model_from(start, init or teacher_path, device)


def blocks_per_story(context: int, config: DistillConfig) -> int:
    blocks = (context - 1 - config.max_opening) // config.block_length  # what fits after the longest prompt
    blocks = min(blocks, config.blocks or blocks)
    if blocks < 1:
        raise UserError(f"a context of {context} leaves no room for a block of {config.block_length} after a "
                        f"prompt of up to {1 + config.max_opening} tokens; use a smaller block")
    return blocks


@torch.no_grad()
def write_trajectories(teacher, tokens, config: DistillConfig, seed: int, desc="teacher") -> np.ndarray:
    """(n, 2, S) int32: per story, row 0 the tokens and row 1 the step of its block at which the
    teacher revealed each position (PROMPT for the prompt, PAD for padding), left-padded to S =
    1 + max_opening + G * N. Stories from `tokens`' openings, one generator seeded from `seed`."""
    N, G = config.block_length, blocks_per_story(teacher.config.context, config)
    S = 1 + config.max_opening + G * N
    openings = [[] for _ in range(config.stories)]
    if config.max_opening:
        openings = story_openings(tokens, config.stories, config.max_opening, seed)
    lengths = np.random.default_rng(seed).integers(0, config.max_opening + 1, config.stories)
    generator = torch.Generator(teacher.embed.weight.device).manual_seed(seed)
    out = np.full((config.stories, 2, S), PAD, dtype=np.int32)
    out[:, 0] = EOT
    for i in progress.bar(range(config.stories), desc=desc, unit="story"):
        prompt = [EOT] + openings[i][:lengths[i]]
        steps = [PROMPT] * len(prompt) + [0] * (G * N)
        taken = {}  # block -> steps taken in it so far

        def record(event):
            step = taken.get(event["block"], 0)
            for position in event["committed"]:
                steps[position] = step
            taken[event["block"]] = step + 1

        ids, _ = generate_cached(teacher, prompt, G * N, G * N, N, config.temperature, config.order,
                                 generator=generator, callback=record)
        out[i, :, S - len(steps):] = [prompt + ids, steps]
    return out


WRITES = ("stories", "block_length", "blocks", "max_opening", "temperature", "order")  # what the trajectories depend on


def load_or_write(path, source: dict, teacher, tokens, config: DistillConfig, seed: int, desc="teacher") -> np.ndarray:
    """The trajectories cached at `path` (.npy, read without pickle; written atomically and stamped: `source`,
    which names the teacher and the data, the seed and the config's WRITES), made once and made again where
    the stamp fails."""
    made_by = {**source, "seed": seed, **{key: getattr(config, key) for key in WRITES}}
    if stamp_holds(path, made_by):
        return np.load(path, allow_pickle=False)
    out = write_trajectories(teacher, tokens, config, seed, desc)
    write_stamped(path, lambda f: np.save(f, out, allow_pickle=False), made_by)
    return out


def sample_rows(trajectories, batch_size: int, seed: int, index: int) -> torch.Tensor:
    """Batch `index` of stories (B, 2, S), from (seed, index) alone like data.sample_windows."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**64)
    return torch.from_numpy(trajectories[torch.randint(len(trajectories), (batch_size,), generator=g).numpy()]).long()


def state(story, block: int, revealed: int, block_length: int) -> torch.Tensor:
    """The teacher's canvas (L,) after `revealed` steps of `block`: earlier blocks its final tokens,
    the block's first `revealed` positions in its reveal order, MASK elsewhere. Padding dropped."""
    tokens, steps = story[:, story[1] != PAD]  # (L,) each
    P = int((steps == PROMPT).sum())
    lo = P + block * block_length
    canvas = tokens.clone()
    canvas[lo:] = MASK
    keep = steps[lo:lo + block_length] < revealed
    canvas[lo:lo + block_length][keep] = tokens[lo:lo + block_length][keep]
    return canvas


def state_mask(prompt_len, S: int, G: int, N: int, shift: int) -> torch.Tensor:
    """(B, S + G(N+s), S + G(N+s)) bool, True = may attend, for [clean story; G block groups].

    In real coordinates u (u < 0: padding), blocks are the prompt (0) and answer blocks 1..G. What
    the cached sampler gives each row: a clean row sees the clean keys up to the end of its block
    (as the sampler computed the keys it cached); a group row of the block starting at lo sees the
    clean keys before lo - s and its own group, except that a shifted group's first row (the
    finished token lo - 1) sees only itself there. Pads see only themselves.
    """
    B, device, s = len(prompt_len), prompt_len.device, shift
    P = prompt_len[:, None]  # (B, 1)
    end = P + G * N  # (B, 1): one past the last real position
    u = torch.arange(S, device=device)[None] - (S - end)  # (B, S)
    real = u >= 0
    block = torch.where(u < P, 0, 1 + torch.div(u - P, N, rounding_mode="floor"))
    last = torch.where(block == 0, P - 1, P + block * N - 1)  # (B, S): the end of that block
    clean = real[:, None, :] & (u[:, None, :] <= last[:, :, None]) & real[:, :, None]  # (B, S, S)
    clean |= torch.eye(S, dtype=torch.bool, device=device) & ~real[:, :, None]
    M = N + s
    lo = (P + torch.arange(G, device=device) * N - s).repeat_interleave(M, 1)  # (B, G*M): each group's first
    group_clean = real[:, None, :] & (u[:, None, :] < lo[:, :, None])  # (B, G*M, S)
    group, index = torch.arange(G, device=device).repeat_interleave(M), torch.arange(M, device=device).repeat(G)
    own = (group[:, None] == group[None, :]) & ((index[:, None] > 0) | (index[None, :] == 0) | (s == 0))
    top = torch.cat([clean, torch.zeros(B, S, G * M, dtype=torch.bool, device=device)], 2)
    return torch.cat([top, torch.cat([group_clean, own.expand(B, -1, -1)], 2)], 1)


def draw_revealed(B: int, G: int, N: int, generator=None, device="cpu") -> torch.Tensor:
    """Steps already taken in each block of each story (B, G): uniform in 0..N-1."""
    return torch.randint(0, N, (B, G), generator=generator, device=device)


def block_states(batch, revealed, N: int, shift: int):
    """Inputs for the one-forward form of every block's state.

    batch (B, 2, S) stories, revealed (B, G). Returns idx and pos (B, S + G(N+s)), mask, and per
    block position (B, G, N): targets (the teacher's tokens), masked (still MASK in the state) and
    ahead (steps until the teacher revealed it: 0 = the next step)."""
    tokens, steps = batch[:, 0], batch[:, 1]  # (B, S)
    B, S = tokens.shape
    G = revealed.shape[1]
    prompt_len = (steps == PROMPT).sum(1)  # (B,)
    M = N + shift
    lo = S - G * N + torch.arange(G, device=tokens.device) * N  # (G,): block starts in padded coordinates
    where = lo[:, None] - shift + torch.arange(M, device=tokens.device)  # (G, M)
    group_tokens, group_steps = tokens[:, where], steps[:, where]  # (B, G, M)
    in_block = torch.arange(M, device=tokens.device) >= shift  # (M,): not the finished token before a block
    masked = in_block & (group_steps >= revealed[:, :, None])  # (B, G, M)
    noisy = torch.where(masked, MASK, group_tokens)
    pad = (S - prompt_len - G * N)[:, None]  # (B, 1)
    pos = torch.cat([(torch.arange(S, device=tokens.device) - pad).clamp(min=0), where.flatten() - pad], 1)
    idx = torch.cat([tokens, noisy.flatten(1)], 1)
    mask = state_mask(prompt_len, S, G, N, shift)
    blocks = (slice(None), slice(None), slice(shift, None))
    return idx, pos, mask, group_tokens[blocks], masked[blocks], (group_steps - revealed[:, :, None])[blocks]


def state_logits(model, idx, pos, mask, S: int, G: int, N: int):
    """The logits of every block position in its state (B, G, N, V), SUBS applied: group row i
    predicts the block's position i (a shifted group is one row longer; its last row is not read)."""
    logits = model(idx, pos=pos, mask=mask, head_from=S)  # (B, G*M, V)
    logits = logits.to(wide(logits.dtype)).view(len(idx), G, -1, logits.shape[-1])[:, :, :N]  # (B, G, N, V)
    return subs_logits(logits, inplace=True)


def certainty(logits, targets, masked, temperature: float = 0.5):
    """dParallel's certainty term: the mean entropy of softmax(logits / temperature) over the
    masked positions whose argmax already equals the target (0 where there are none)."""
    right = masked & (logits.detach().argmax(-1) == targets)
    if not right.any():
        return logits.new_zeros(())
    z = (logits[right] / temperature).clamp(min=-1e9)  # (n, V): SUBS's -inf made finite, so that
    logp = torch.log_softmax(z, -1)  # p log p at p = 0 is 0 with a gradient of 0, not NaN
    return -(logp.exp() * logp).sum(-1).mean()


def distill_terms(logits, targets, masked, ahead, config: DistillConfig, teacher_logits=None):
    """(loss, stats) from the student's logits (B, G, N, V) on its states."""
    n = masked.sum().clamp(min=1)
    ce = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none").view(targets.shape)
    per_position = ce
    if config.loss == "tad":  # far positions: KL to the teacher's whole distribution at that state
        far = ahead >= config.tad_horizon
        teacher_logp = torch.log_softmax(teacher_logits, -1)
        p = teacher_logp.exp()  # 0 at the MASK id, where both log-probabilities are -inf
        kl = torch.where(p > 0, p * (teacher_logp - torch.log_softmax(logits, -1)), 0.0).sum(-1)  # grad 0 there
        per_position = torch.where(far, kl, ce)
    base = (per_position * masked).sum() / n
    sure = certainty(logits, targets, masked, config.certainty_temperature)
    loss = base + config.certainty_weight * sure
    right = (logits.detach().argmax(-1) == targets) & masked
    return loss, {"distill": loss.detach(), "masked_ce": ((ce * masked).sum() / n).detach(),
                  "certainty": sure.detach(), "acc": right.sum() / n}


def corpus_anchor(objective, tokens, batch_size: int, window: int, seed: int):
    """anchor(model, generator) -> (loss, stats): `objective` on B corpus windows, the batch drawn
    from the step's noise generator, so a resumed run replays it."""
    def anchor(model, generator, device):
        index = int(torch.randint(2**62, (1,), generator=generator, device=device))
        return objective(model, sample_windows(tokens, batch_size, window, seed, index).to(device), generator)

    return anchor


def make_loss(config: DistillConfig, teacher=None, anchor=None):
    """loss(model, batch (B, 2, S), generator) -> (loss, stats), train.py's objective signature.
    A MoE student adds its balance term, as its own training did. With anchor_weight > 0 a training
    step adds anchor_weight * anchor(model, generator, device)'s loss; validation (model.eval()) reports the
    distillation terms alone, on the validation trajectories."""
    if config.loss == "tad" and teacher is None:
        raise UserError("TAD's loss needs the teacher's distributions: pass the teacher")
    if config.anchor_weight and anchor is None:
        raise UserError("--anchor-weight needs corpus windows to anchor on: pass the anchor")

    def distill_loss(model, batch, generator=None):
        N, shift = config.block_length, int(model.config.shift)
        S, G = batch.shape[-1], blocks_per_story(model.config.context, config)
        revealed = draw_revealed(len(batch), G, N, generator, batch.device)
        idx, pos, mask, targets, masked, ahead = block_states(batch, revealed, N, shift)
        teacher_logits = None
        if config.loss == "tad":
            with torch.no_grad():
                teacher_logits = state_logits(teacher, idx, pos, mask, S, G, N)
        logits = state_logits(model, idx, pos, mask, S, G, N)
        loss, stats = distill_terms(logits, targets, masked, ahead, config, teacher_logits)
        if hasattr(model.config, "balance_coef"):  # a MoE student
            loss = loss + model.config.balance_coef * balance_loss(model)
        if config.anchor_weight and model.training:
            anchored, _ = anchor(model, generator, batch.device)
            loss = loss + config.anchor_weight * anchored
            stats["anchor"] = anchored.detach()
        return loss, stats

    return distill_loss


FLAGS = {"stories": "distill_stories", "certainty_weight": "certainty_weight", "loss": "distill_loss",  # field ->
         "temperature": "teacher_temperature", "order": "teacher_order", "anchor_weight": "anchor_weight"}  # setting


def distill_run(run: dict, out, train_tokens, val_tokens, device="cpu", objective=None):
    """train.py's hook for a --distill run: (loss, draw(step) -> batch, validation batch). The
    teacher's trajectories are written once into the run folder (from the validation split's
    openings for validation), so a resumed run trains on the same stories. `objective` is the
    student kind's own loss, for the anchor."""
    config = DistillConfig(**{key: run[flag] for key, flag in FLAGS.items() if run.get(flag) is not None})
    teacher, _ = load_teacher(run["distill"], run["model"], device)
    source = {"teacher": run["distill"], "data": run["data"]}
    train = load_or_write(out / "trajectories.npy", source, teacher, train_tokens, config, run["seed"],
                          "teacher (training)")
    rows = run["eval_batches"] * run["batch_size"]
    # the validation batches (or a tenth of the stories), never more stories than the run trains on: a
    # request for 4 writes 4 more, not 256
    val_config = replace(config, stories=min(max(rows, config.stories // 10), config.stories))
    val = load_or_write(out / "trajectories-val.npy", source, teacher, val_tokens, val_config, run["seed"],
                        "teacher (validation)")
    print(f"distilling {run['distill']}: {len(train):,} stories of {train.shape[-1]} tokens written at temperature "
          f"{config.temperature:g} in {config.order.replace('_', '-')} order, {config.loss} loss, "
          f"certainty weight {config.certainty_weight:g}"
          + (f", anchor weight {config.anchor_weight:g}" if config.anchor_weight else ""))
    anchor = None
    if config.anchor_weight:
        anchor = corpus_anchor(objective, train_tokens, run["batch_size"], teacher.config.context, run["seed"])

    def draw(step: int):
        return sample_rows(train, run["batch_size"], run["seed"], step).to(device)

    return make_loss(config, teacher, anchor), draw, torch.from_numpy(val[:rows]).long().to(device)
