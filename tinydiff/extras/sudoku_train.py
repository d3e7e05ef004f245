"""python -m tinydiff.extras.sudoku_train: the Sudoku lesson's two models, trained for the same minutes, then measured.

    python -m tinydiff.extras.sudoku_train --out out/sudoku     # 6 + 6 minutes on 2 CPU cores, then ~2 of measuring

Trains the masked-diffusion model (tinydiff/extras/sudoku.py: the core Transformer, bidirectional, the core's
`mdlm_loss` on solved grids) and the AR baseline (the same Transformer, causal, `answer_loss` on [puzzle; solution])
for --minutes each, on fresh grids every step, with the same size, batch and learning rate; saves both (OUT/mdlm.pt,
OUT/ar.pt, with the steps each took); then solves the held-out puzzles with each: the diffusion model in every order
of the sampler, and with the rules that fill several cells a step (`measure`), the AR model left to right.
The held-out grids (sudoku.held_out) are never trained on: a training batch drops any of them.
Leaves out: resuming a run (minutes, not hours), learning-rate decay.
"""
import sys
import time
from pathlib import Path

import torch

from tinydiff.checks import COUNT, SEED, Rule, UserError
from tinydiff.diffusion import mdlm_loss
from tinydiff.extras.sudoku import (
    HELD_OUT,
    HOLE,
    Board,
    answer_loss,
    held_out,
    puzzles,
    solve,
    solve_ar,
    solved,
    sudoku_model,
    training_grids,
)
from tinydiff.io.checkpoint import check_weights_fit, implied_params, load_checkpoint, save_checkpoint
from tinydiff.io.cli import add_device, check_device, check_fits, make_parser, run_main
from tinydiff.io.files import check_run_folder, claim_run_folder
from tinydiff.model import ModelConfig
from tinydiff.sampler import REMASKING

KINDS = {"mdlm": "sudoku-mdlm", "ar": "sudoku-ar"}  # the checkpoint kind of each model
PARALLEL = [{"cells_per_step": 2}, {"cells_per_step": 3}, {"threshold": 0.99}, {"threshold": 0.95},
            {"threshold": 0.9}, {"threshold": 0.8}, {"entropy_bound": 0.1}, {"entropy_bound": 0.5}]


def train(model, kind: str, board: Board, steps: int | None = None, seconds: float | None = None, holes: int = 27,
          batch_size: int = 64, lr: float = 2e-3, warmup: int = 100, seed: int = 0) -> int:
    """AdamW on fresh grids until `steps` steps or `seconds` of training have passed; returns the steps taken.
    The diffusion model learns solved grids (the core's mdlm_loss), the AR model [puzzle; solution] pairs
    with `holes` random holes (answer_loss). The rate rises linearly over the first `warmup` steps: without it
    either model can stall for thousands of steps on a plateau (the AR model copying its givens, and nothing
    else), which seed decides (dev/LOG.md)."""
    device = model.embed.weight.device
    data, noise = torch.Generator().manual_seed(seed), torch.Generator(device).manual_seed(seed)  # grids on the CPU
    draw = training_grids(board, data)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model.train()
    start, step = time.perf_counter(), 0
    while (steps is None or step < steps) and (seconds is None or time.perf_counter() - start < seconds):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        grid = draw(batch_size)  # (B, cells)
        if kind == "mdlm":
            loss, _ = mdlm_loss(model, grid.to(device), noise)
        else:
            loss = answer_loss(model, puzzles(grid, holes, data).to(device), grid.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
    model.eval()
    return step


def save(path, model, kind: str, board: Board, steps: int, seconds: float):
    save_checkpoint(path, kind=KINDS[kind], config=model.config, model=model,
                    board=[board.box_rows, board.box_cols], step=steps, seconds=seconds)


def load(path, kind: str, device="cpu"):
    """(model in eval mode, checkpoint dict) of a Sudoku model of `kind` ("mdlm" or "ar") saved by this trainer."""
    ckpt = load_checkpoint(path, kinds=(KINDS[kind],))
    shape = ckpt.get("board")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(s) is int and 2 <= s <= 4 for s in shape)):
        raise UserError(f"{path}: its board is not [box rows, box cols] of 2 to 4 each: it is damaged")
    board = Board(*shape)
    try:
        config = ModelConfig(**ckpt["config"])
    except (TypeError, UserError) as e:
        raise UserError(f"{path}: not a model config ({e})") from None
    if config.vocab_size != board.n or config.causal != (kind == "ar"):
        raise UserError(f"{path}: its config does not fit a {kind} model of a {board.n}x{board.n} board: it is damaged")
    args = dict(n_layer=config.n_layer, n_head=config.n_head, d_model=config.d_model, d_ff=config.d_ff)
    if implied_params(config) > 1.1 * sum(t.numel() for t in ckpt["model"].values()):  # a config past its weights
        with torch.device("meta"):
            check_weights_fit(sudoku_model(board, kind == "ar", **args), ckpt["model"], path)
    model = sudoku_model(board, kind == "ar", **args)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise UserError(f"{path}: weights do not fit its config ({str(e).splitlines()[0]})") from None
    return model.to(device).eval(), ckpt


def rate(board: Board, puzzle, solver) -> tuple[float, float]:
    """(solve rate, forwards per puzzle) of solver(puzzle) -> (boards, forwards each)."""
    boards, forwards = solver(puzzle)
    return solved(board, boards, puzzle).float().mean().item(), forwards.float().mean().item()


def measure(board: Board, mdlm, ar, puzzle, order: str = "top_margin") -> dict:
    """Rows (what, solve rate, forwards per puzzle): "orders", the diffusion model in each order of the sampler, one
    cell a step; "ar", the AR model's; "parallel", `order` one cell a step and then with each rule of PARALLEL."""
    def diffusion(**rule):  # random orders drawn from a fixed seed
        return lambda p: solve(mdlm, p, generator=torch.Generator(p.device).manual_seed(0), **rule)

    orders = [(name, *rate(board, puzzle, diffusion(order=name))) for name in REMASKING]
    parallel = [(f"{order}, cells per step 1", *orders[REMASKING.index(order)][1:])]
    for rule in PARALLEL:
        what = ", ".join(f"{key.replace('_', ' ')} {value}" for key, value in rule.items())
        parallel.append((f"{order}, {what}", *rate(board, puzzle, diffusion(order=order, **rule))))
    return {"orders": orders, "ar": ("ar, left to right", *rate(board, puzzle, lambda p: solve_ar(ar, p))),
            "parallel": parallel}


def fewest_forwards(rows: dict, best: float, holes: float, points: float = 0.02) -> str:
    """In words: the row of rows["parallel"] with the fewest forwards per puzzle whose solve rate is within `points`
    of `best`."""
    row = min((row for row in rows["parallel"] if row[1] >= best - points), key=lambda row: row[2], default=None)
    if row is None:
        return "none (the margin order itself is further from the best order)"
    what, solved_rate, forwards = row
    return f"{what}, {solved_rate:.1%} at {forwards:.2f} forwards ({forwards / holes:.2f} a hole)"


def parse_board(text: str) -> Board:
    rows, _, cols = text.partition("x")
    if not (rows.isdigit() and cols.isdigit() and 2 <= int(rows) <= 4 and 2 <= int(cols) <= 4):
        raise UserError(f"--board must be BOX_ROWSxBOX_COLS, each 2 to 4 (2x3: a 6x6 board, 3x3: 9x9), got {text!r}")
    return Board(int(rows), int(cols))


def main(argv=None):
    p = make_parser("python -m tinydiff.extras.sudoku_train", "Train the Sudoku lesson's diffusion and AR models "
                    "for the same minutes, save them, and measure both on held-out puzzles.")
    p.add_argument("--out", default="out/sudoku", help="folder for mdlm.pt and ar.pt")
    p.add_argument("--minutes", type=Rule(above=0, hi=24 * 60), default=6.0, help="training time of each model")
    p.add_argument("--board", default="2x3", help="box rows x box cols: 2x3 is a 6x6 board, 3x3 the 9x9 one")
    p.add_argument("--holes", type=COUNT, default=27, help="hidden cells of each puzzle (held-out: one solution)")
    p.add_argument("--puzzles", type=Rule(integer=True, lo=1, hi=HELD_OUT), default=HELD_OUT, help="held-out puzzles")
    p.add_argument("--d-model", type=Rule(integer=True, lo=8, hi=4096), default=64, help="width of both models")
    p.add_argument("--n-layer", type=Rule(integer=True, lo=1, hi=64), default=4, help="blocks of both models")
    p.add_argument("--batch-size", type=Rule(integer=True, lo=1, hi=65536), default=64)
    p.add_argument("--lr", type=Rule(above=0, hi=1), default=2e-3)
    p.add_argument("--seed", type=SEED, default=0)
    add_device(p)
    args = p.parse_args(argv)
    board = parse_board(args.board)
    check_device(args.device)
    if args.holes >= board.cells:
        raise UserError(f"--holes must leave some givens on a {board.n}x{board.n} board: at most {board.cells - 1}")
    if args.d_model % 8:
        raise UserError(f"--d-model must be a multiple of 8 (4 heads of an even size), got {args.d_model}")
    with torch.device("meta"):  # sized, not allocated: the AR model reads two boards, so its step is the larger
        ar = sudoku_model(board, True, n_layer=args.n_layer, d_model=args.d_model, d_ff=3 * args.d_model)
    check_fits(ar, "fp32", args.batch_size, args.device, smaller="--d-model or --n-layer")
    out = Path(args.out)
    check_run_folder(out)
    taken = [kind for kind in KINDS if (out / f"{kind}.pt").exists()]
    if taken:
        raise UserError(f"{out} already holds {taken[0]}.pt; delete it or pass another --out")
    puzzle, _ = held_out(board, args.puzzles, args.holes)  # before training: a hole count no puzzle has fails now
    puzzle = puzzle.to(args.device)
    models = {}
    with claim_run_folder(out):
        for kind in KINDS:
            torch.manual_seed(args.seed)
            model = sudoku_model(board, kind == "ar", n_layer=args.n_layer, d_model=args.d_model,
                                 d_ff=3 * args.d_model).to(args.device)
            start = time.perf_counter()
            steps = train(model, kind, board, seconds=60 * args.minutes, holes=args.holes,
                          batch_size=args.batch_size, lr=args.lr, seed=args.seed)
            seconds = time.perf_counter() - start
            save(out / f"{kind}.pt", model, kind, board, steps, seconds)
            print(f"{kind}: {model.num_params():,} parameters | {steps:,} steps | {seconds / 60:.1f} min | "
                  f"{out / f'{kind}.pt'}")
            models[kind] = model
    rows = measure(board, models["mdlm"], models["ar"], puzzle)
    holes = (puzzle == HOLE).sum(1).float().mean().item()
    print(f"\n{len(puzzle):,} held-out puzzles, {board.n}x{board.n}, {args.holes} holes, one solution each")
    print(f"{'rule':<40} {'solved':>7} {'forwards':>9} {'per hole':>9}")
    for what, solved_rate, forwards in [*rows["orders"], rows["ar"], *rows["parallel"]]:
        print(f"{what:<40} {solved_rate:>7.1%} {forwards:>9.2f} {forwards / holes:>9.2f}")
    best = max(r for _, r, _ in rows["orders"])
    print(f"fewest forwards within 2 points of the best order's {best:.1%}: {fewest_forwards(rows, best, holes)}")


if __name__ == "__main__":
    sys.exit(run_main(main, interrupted="a model is saved when its minutes are over, in --out"))
