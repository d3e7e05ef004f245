"""Lesson 16: why diffusion at all: on Sudoku a diffusion model plans its order, and an AR model of its size cannot.

Run: python lessons/16_sudoku.py [--quick] [--mdlm out/sudoku/mdlm.pt --ar out/sudoku/ar.pt]
Train those two: python -m tinydiff.extras.sudoku_train (6 + 6 minutes on 2 CPU cores, then it measures both).
Read next: tinydiff/extras/sudoku.py (the puzzles, the board's embedding, both solvers) and the `top_margin` rule in
tinydiff/sampler.py's propose; lesson 06 for the rules that fill several positions a step.

On stories (lessons 04-06) the diffusion LM is slower and worse than the AR model beside it. On Sudoku it is not,
and the order it decodes in is why. Both models here are the core's Transformer, the same size and trained for the
same minutes: the diffusion model with the core's mdlm_loss on solved grids, the AR model on the puzzle followed by
its solution. The diffusion model is solved with the core's sampler step; only the order changes between rows.
The trained pair (python -m tinydiff.extras.sudoku_train: 6 minutes each, 6,797 and 3,268 steps; AMD EPYC, 2 cores,
2026-12-07), on 1,000 held-out 6x6 puzzles, 27 of 36 cells hidden, one solution each:
    diffusion, one cell a step: lowest entropy 95.6%, highest probability 95.5%, top_margin 95.4%,
                                reading order 39.5%, random 33.2%
    AR, reading order:          2.2%
    top_margin, threshold 0.95: 94.9% at 5.95 forwards a puzzle (0.22 a hole; one cell a step: 27)
The three planned orders tie within their noise (a point either way on 1,000 puzzles): what matters is that there
is a plan. Without checkpoints this lesson trains both for a few hundred steps first (half a minute), so its numbers
are lower; the order effect is the same.
"""
import os
import tempfile
import time

import common  # lessons/common.py: the repository on sys.path, the flags, one thread, the seed
import torch

from tinydiff.checks import UserError
from tinydiff.extras.sudoku import HOLE, Board, board_text, held_out, solve, sudoku_model
from tinydiff.extras.sudoku_train import fewest_forwards, load, measure, train
from tinydiff.tools.replay import Recorder

args = common.setup(__doc__, "fewer training steps and puzzles",
                    mdlm=(["out/sudoku/mdlm.pt"], "the diffusion model (python -m tinydiff.extras.sudoku_train)"),
                    ar=(["out/sudoku/ar.pt"], "the AR model trained beside it"), needs={"mdlm": "ar", "ar": "mdlm"})
board, holes = Board(2, 3), 27
count, steps = (30, 150) if args.quick else (60, 300)

print(f"1. The puzzles: a {board.n}x{board.n} board of {board.box_rows}x{board.box_cols} boxes, each row, column and "
      f"box holding 1..{board.n} once.")
print(f"   {count} held-out puzzles, {holes} of {board.cells} cells hidden, exactly one solution each "
      "(made here: tinydiff/extras/sudoku.py). The first:")
puzzle, solution = held_out(board, count, holes)
print(board_text(board, puzzle[0]))

print("\n2. Two models of one size: the core's Transformer on the digits' vocabulary, each cell's row, column and")
print("   box embedded beside its digit. The diffusion model learns solved grids with masked diffusion's loss; the AR")
if args.mdlm and args.ar:
    models = {}
    for kind, path in (("mdlm", args.mdlm), ("ar", args.ar)):
        models[kind], ckpt = load(path, kind)
        if ckpt["board"] != [board.box_rows, board.box_cols]:
            raise UserError(f"{path} holds a model of another board; this lesson's puzzles are 6x6 (--board 2x3)")
    print(f"   model learns the puzzle then its solution. Trained: {args.mdlm}, {args.ar}")
else:
    print(f"   model learns the puzzle then its solution. No checkpoints: {steps} steps for the diffusion model and")
    print(f"   {steps // 2} for the AR model, the same time: its sequences (puzzle, then answer) are twice as long.")
    models = {}
    for kind, kind_steps in (("mdlm", steps), ("ar", steps // 2)):
        torch.manual_seed(args.seed)
        models[kind] = sudoku_model(board, kind == "ar")
        start = time.perf_counter()
        train(models[kind], kind, board, steps=kind_steps, holes=holes, batch_size=32, seed=args.seed)
        print(f"   {kind}: {models[kind].num_params():,} parameters, {kind_steps} steps, "
              f"{time.perf_counter() - start:.0f} s")

print("\n3. Order is the lesson. One cell a step, the most likely digit; only the order differs (sampler.propose):")
print("   random, reading order, highest probability, lowest entropy, and Kim et al.'s largest gap between the")
print("   two likeliest digits (top_margin). The AR model can only go in reading order.")
rows = measure(board, models["mdlm"], models["ar"], puzzle)
print(f"   {'order':<22} solved  forwards")
for what, rate, forwards in [*rows["orders"], rows["ar"]]:
    print(f"   {what:<22} {rate:6.1%}  {forwards:8.1f}")
best = max(rows["orders"], key=lambda row: row[1])
random_order = next(r for what, r, _ in rows["orders"] if what == "random")
print(f"   best order: {best[0]} {best[1]:.1%} | random: {random_order:.1%} | ar: {rows['ar'][1]:.1%}")

print("\n4. Why: before the first step the model is sure of some holes and unsure of others. Its margins (top")
print("   probability minus the second) on the first puzzle:")
with torch.no_grad():
    probs = models["mdlm"](puzzle[:1], causal=False)[0].softmax(-1)  # (cells, n)
top2 = probs.topk(2, -1).values
margin = top2[:, 0] - top2[:, 1]
open_cells = (puzzle[0] == HOLE).nonzero()[:, 0].tolist()
ranked = sorted(open_cells, key=lambda i: -margin[i])


def where(cell: int) -> str:
    return f"row {cell // board.n + 1} column {cell % board.n + 1}"


print("   surest: " + ", ".join(f"{where(i)} {margin[i]:.2f}" for i in ranked[:3]))
print(f"   the first hole in reading order, where left to right must start: {where(open_cells[0])} "
      f"{margin[open_cells[0]]:.2f}")
steps_seen = []
recorder = Recorder("sudoku, top_margin", None, [], f"{board.n}x{board.n} Sudoku, {holes} holes", board=board,
                    puzzle=puzzle[0])
filled, _ = solve(models["mdlm"], puzzle[:1], "top_margin",
                  callback=lambda event: (steps_seen.append(event["committed"][0]), recorder(event)))
print("   top_margin fills, in order: " + ", ".join(f"{where(i)} = {int(filled[0, i]) + 1}" for i in steps_seen[:4])
      + ", ...")
print(board_text(board, filled[0]))
print(f"   the solution: {'yes' if torch.equal(filled[0], solution[0]) else 'no'}")
page = os.path.abspath(recorder.write(os.path.join(tempfile.gettempdir(), "tinydiff-lesson16.html"), overwrite=True))
print(f"   every step, as a page: open {page} in a browser")

print("\n5. Fewer forwards, same answers: the margin order with several cells a step (a fixed K, a threshold on the")
print("   margin, or lesson 06's entropy bound). A forward that fills a sure cell and a guessed one in the same")
print("   step cannot see the first before it guesses the second, so the rules that wait for sureness keep the rate.")
print(f"   {'rule':<36} solved  forwards  per hole")
for what, rate, forwards in rows["parallel"]:
    print(f"   {what:<36} {rate:6.1%}  {forwards:8.1f}  {forwards / holes:8.2f}")
print(f"   fewest forwards within 2 points of the best order: {fewest_forwards(rows, best[1], holes)}")
