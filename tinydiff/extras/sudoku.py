"""Sudoku: a second corpus, on which a masked-diffusion model plans the order it decodes in.

On stories at our scale a diffusion LM trails an AR model. On Sudoku it does not, and the reason is
the order: some cells of a puzzle follow from the givens at once, others only once those are filled.
A masked-diffusion model trained on solved grids predicts every hole at each step, so the sampler
can fill the cell it is surest of first; an AR model must write the cells in reading order, hard
ones included. Ye et al. (ICLR 2025, "Beyond Autoregression") solve Sudoku with a small
masked-diffusion model where an AR one fails; Kim et al. (ICML 2025, "Train for the Worst, Plan for
the Best") show that the order does it: the same model fails in random order and succeeds when each
step fills the cell whose two likeliest digits lie furthest apart (sampler.py's `top_margin`).

What is here, each piece the core's where there is one:
  - the puzzles, made here: 64 random grids (a randomized depth-first search) varied by the board's
    symmetries (digits relabelled, rows swapped inside a band and bands swapped, columns inside a
    stack and stacks, a transpose where the boxes are square), holes at random cells, or as many as
    keep exactly one solution (the same search counts them), and the checker of a filled board;
  - a vocabulary of the digits (ids 0..n-1 for 1..n) and the core's MASK for a hole: the model's
    head has n outputs, never MASK's, and MASK enters through an input row of its own;
  - the board's structure, the one addition to the core's Transformer: each cell's row, column and
    box embedded beside its digit (`CellEmbedding`). RoPE's positions along one line of 36 cells
    do not say that cells 0 and 6 share a column: after 2 minutes on 2 CPU cores the default model
    solves 91% of the held-out puzzles with the units embedded, 19% with positions alone;
  - the masked-diffusion model: the core Transformer, trained with the core's `mdlm_loss` on solved
    grids, solved by the core's diffusion step (`sampler.commit`) in any of its orders;
  - the AR baseline: the same Transformer, causal, trained on [puzzle; solution] with next-token
    cross-entropy on the solution (`answer_loss`) and solved greedily in reading order.
Training both, and the measurements: tinydiff/extras/sudoku_train.py. The lesson: lessons/16_sudoku.py.
Leaves out: puzzles rated by the deductions they need (difficulty here is the number of holes, with
one solution), 9x9 training on a CPU (the same code, `Board(3, 3)`, a GPU's work), self-correction.
"""
import random
from dataclasses import dataclass
from itertools import islice

import torch
import torch.nn as nn
import torch.nn.functional as F

from tinydiff.checks import UserError
from tinydiff.model import ModelConfig, Transformer
from tinydiff.sampler import check_rule, commit
from tinydiff.tokenizer import MASK

HOLE = MASK  # a hole is the core's MASK: what its noising writes and its sampler fills
HELD_OUT = 1000  # held-out grids, the puzzles every measurement solves: never trained on
SEEDS = {"bases": 0, "held-out grids": 1, "held-out puzzles": 2}


@dataclass(frozen=True)
class Board:
    box_rows: int = 2  # a box is box_rows x box_cols cells; the board n x n with n = box_rows * box_cols
    box_cols: int = 3

    @property
    def n(self) -> int:
        """Digits, and cells a row, a column or a box holds."""
        return self.box_rows * self.box_cols

    @property
    def cells(self) -> int:
        return self.n * self.n

    def units(self):
        """(cells, 3): each cell's row, column and box, in reading order (cell i is row i // n, column i % n)."""
        cell = torch.arange(self.cells)
        row, col = cell // self.n, cell % self.n
        box = row // self.box_rows * self.box_rows + col // self.box_cols  # boxes in reading order
        return torch.stack([row, col, box], 1)

    def peers(self) -> list[list[int]]:
        """Each cell's peers: the other cells of its row, column and box."""
        units = self.units().tolist()
        return [[j for j in range(self.cells) if j != i and any(a == b for a, b in zip(units[i], units[j]))]
                for i in range(self.cells)]


def solutions(board: Board, cells: list[int], rng=None, peers=None):
    """The solutions of a board (cells: a digit id or HOLE each), found lazily, depth first: always at the hole with
    the fewest digits its peers leave it (a set bit each), those digits in order, or in a random order given `rng`
    (a random.Random). next(solutions(board, [HOLE] * board.cells, rng)) is a random valid grid."""
    peers = peers or board.peers()
    cells, full = list(cells), (1 << board.n) - 1

    def search():
        best, best_options = None, 0
        for i, digit in enumerate(cells):
            if digit == HOLE:
                options = full & ~sum({1 << cells[j] for j in peers[i] if cells[j] != HOLE})
                if options == 0:
                    return  # a dead end
                if best is None or options.bit_count() < best_options.bit_count():
                    best, best_options = i, options
        if best is None:
            yield list(cells)  # no hole left
            return
        digits = [d for d in range(board.n) if best_options >> d & 1]
        for digit in rng.sample(digits, len(digits)) if rng else digits:
            cells[best] = digit
            yield from search()
        cells[best] = HOLE

    return search()


def count_solutions(board: Board, cells: list[int], limit: int = 2, peers=None) -> int:
    """How many solutions a board has, counted up to `limit`."""
    return len(list(islice(solutions(board, cells, peers=peers), limit)))


def random_grids(board: Board, count: int, seed: int):
    """count valid grids (count, cells) from a randomized search of the empty board: the bases `grids` varies."""
    rng, peers = random.Random(seed), board.peers()
    return torch.tensor([next(solutions(board, [HOLE] * board.cells, rng, peers)) for _ in range(count)])


def shuffled_lines(count: int, groups: int, size: int, generator):
    """(count, groups * size): line indices with the groups (bands or stacks) permuted and the lines in each."""
    order = torch.rand(count, groups, generator=generator).argsort(-1)  # (count, groups)
    within = torch.rand(count, groups, size, generator=generator).argsort(-1)  # (count, groups, size)
    return (order[:, :, None] * size + within).flatten(1)


def grids(board: Board, count: int, bases, generator):
    """count valid grids (count, cells), digit ids 0..n-1: each a random one of `bases` (K, cells) under random
    symmetries. One 6x6 grid's symmetries make only ~104,000 grids, of the 28 million there are: a few dozen
    bases (random_grids) make them all likely."""
    n = board.n
    x = bases.view(-1, n, n)[torch.randint(len(bases), (count,), generator=generator)]  # (count, n, n)
    rows = shuffled_lines(count, board.box_cols, board.box_rows, generator)  # box_cols bands of box_rows rows
    cols = shuffled_lines(count, board.box_rows, board.box_cols, generator)  # box_rows stacks of box_cols columns
    x = x.gather(1, rows[:, :, None].expand(-1, -1, n)).gather(2, cols[:, None, :].expand(-1, n, -1))
    digits = torch.rand(count, n, generator=generator).argsort(-1)  # a relabelling per grid
    x = digits.gather(1, x.flatten(1)).view(count, n, n)
    if board.box_rows == board.box_cols:  # square boxes: the transpose is a symmetry too
        flip = torch.rand(count, generator=generator) < 0.5
        x = torch.where(flip[:, None, None], x.transpose(1, 2), x)
    return x.flatten(1)


def puzzles(solutions, holes: int, generator):
    """Each grid (B, cells) with `holes` random cells made HOLE: most such puzzles have several solutions."""
    order = torch.rand(solutions.shape, generator=generator, device=solutions.device).argsort(-1)  # (B, cells)
    return solutions.scatter(1, order[:, :holes], HOLE)


def unique_puzzles(board: Board, solutions, holes: int, seed: int, tries: int = 100):
    """Each grid (B, cells) with `holes` cells made HOLE such that it keeps exactly one solution: cells are emptied
    in a random order, and one is filled again when emptying it admits a second solution; a grid that runs out of
    cells first starts again in a new order (`tries` times at most). Seeded: the same seed, the same puzzles."""
    rng, peers, out = random.Random(seed), board.peers(), []
    for grid in solutions.tolist():
        cells = list(grid)
        for _ in range(tries):
            if cells.count(HOLE) == holes:
                break
            cells = list(grid)
            for i in rng.sample(range(board.cells), board.cells):
                cells[i] = HOLE
                if count_solutions(board, cells, 2, peers) > 1:
                    cells[i] = grid[i]
                elif cells.count(HOLE) == holes:
                    break
        if cells.count(HOLE) != holes:
            raise UserError(f"no puzzle with one solution and {holes} holes turned up in {tries} tries; ask for "
                            f"fewer holes (a 6x6 board's unique puzzles have at most 28)")
        out.append(cells)
    return torch.tensor(out)


def bases(board: Board):
    """The 64 random grids that `grids` varies, the same on every run."""
    return random_grids(board, 64, SEEDS["bases"])


def held_out(board: Board, count: int, holes: int):
    """(puzzles, solutions) (count, cells): the first `count` of the HELD_OUT grids, each with `holes` holes and one
    solution. The same on every run, and a larger count only adds puzzles."""
    if not 1 <= count <= HELD_OUT:
        raise UserError(f"the held-out puzzles number 1 to {HELD_OUT:,}, got {count:,}")
    grid = grids(board, HELD_OUT, bases(board), torch.Generator().manual_seed(SEEDS["held-out grids"]))[:count]
    return unique_puzzles(board, grid, holes, SEEDS["held-out puzzles"]), grid


def training_grids(board: Board, generator):
    """draw(B): B fresh grids (at most B, cells) from `bases(board)`, any of the HELD_OUT grids left out."""
    base = bases(board)
    held = grids(board, HELD_OUT, base, torch.Generator().manual_seed(SEEDS["held-out grids"]))
    held = {tuple(grid) for grid in held.tolist()}

    def draw(count: int):
        grid = grids(board, count, base, generator)
        return grid[torch.tensor([tuple(g) not in held for g in grid.tolist()])]

    return draw


def solved(board: Board, canvas, puzzle):
    """(B,) bool: each canvas (B, cells) is a valid grid (every row, column and box holds each digit once) that
    keeps every given of its puzzle. A puzzle with several solutions counts any of them."""
    n = board.n
    x = canvas.view(-1, n, n)
    boxes = x.view(-1, board.box_cols, board.box_rows, board.box_rows, board.box_cols).transpose(2, 3)
    digits = torch.arange(n, device=canvas.device)
    each_once = [(unit.reshape(-1, n, n).sort(-1).values == digits).all(-1).all(-1)
                 for unit in (x, x.transpose(1, 2), boxes)]  # rows, columns, boxes: each sorted is 0..n-1
    keeps = ((puzzle == HOLE) | (canvas == puzzle)).all(-1)
    return each_once[0] & each_once[1] & each_once[2] & keeps


def board_text(board: Board, cells, indent: str = "   ") -> str:
    """A board (cells,) as lines of digits, "." for a hole, lines between the boxes."""
    n, cells = board.n, [int(c) for c in cells]
    lines = []
    for r in range(n):
        if r and r % board.box_rows == 0:
            lines.append(indent + "+".join(["-" * (2 * board.box_cols + 1)] * board.box_rows))
        row = ["." if d == HOLE else str(d + 1) for d in cells[r * n:(r + 1) * n]]
        groups = [" ".join(row[c:c + board.box_cols]) for c in range(0, n, board.box_cols)]
        lines.append(indent + " " + " | ".join(groups))
    return "\n".join(lines)


class CellEmbedding(nn.Module):
    """The token embedding plus each cell's row, column and box: x_i = E[digit_i] + U[row_i] + U[n + col_i] +
    U[2n + box_i]. Position i of a sequence is cell i % cells, so the AR model's answer (its second board) reads
    the same cells as its puzzle. A sequence starts at cell 0: no KV cache, whole sequences each forward."""

    def __init__(self, board: Board, weight: nn.Parameter):
        super().__init__()
        self.n = board.n
        self.weight = weight  # (padded rows, D): rows 0..n-1 the digits (the tied head reads them), row n MASK
        self.unit = nn.Embedding(3 * board.n, weight.shape[1])  # n rows, n columns, n boxes
        nn.init.normal_(self.unit.weight, std=0.02)
        self.register_buffer("unit_ids", board.units() + torch.arange(3) * board.n, persistent=False)  # (cells, 3)

    def forward(self, ids):
        cells = torch.arange(ids.shape[1], device=ids.device) % len(self.unit_ids)  # (T,)
        tokens = F.embedding(torch.where(ids == HOLE, self.n, ids), self.weight)  # (B, T, D)
        return tokens + self.unit(self.unit_ids[cells]).sum(-2)  # (T, 3, D) summed: (T, D), broadcast over B


def sudoku_model(board: Board, causal: bool, n_layer: int = 4, n_head: int = 4, d_model: int = 64,
                 d_ff: int = 192) -> Transformer:
    """The core Transformer on the digits' vocabulary with CellEmbedding: a masked-diffusion model (bidirectional,
    one board) or the AR baseline (causal, puzzle then answer: two boards). The default is ~0.2M parameters."""
    config = ModelConfig(vocab_size=board.n, context=board.cells * (2 if causal else 1), n_layer=n_layer,
                         n_head=n_head, d_model=d_model, d_ff=d_ff, causal=causal)
    model = Transformer(config)
    model.embed = CellEmbedding(board, model.embed.weight)
    return model


def answer_loss(model, puzzle, solution):
    """The AR baseline's loss on [puzzle; solution] (B, 2 cells): next-token cross-entropy over the solution's
    cells only (ar.ar_loss restricted to the answer: the puzzle is given, not predicted)."""
    cells = puzzle.shape[1]
    seq = torch.cat([puzzle, solution], 1)  # (B, 2 cells)
    logits = model(seq[:, :-1], causal=True)[:, cells - 1:]  # (B, cells, n): output i predicts token i + 1
    return F.cross_entropy(logits.flatten(0, 1), solution.flatten())


@torch.no_grad()
def solve(model, puzzle, order: str = "top_margin", cells_per_step: int = 1, threshold=None,
          entropy_bound=None, generator=None, callback=None):
    """Fill the holes of puzzles (B, cells) with the masked-diffusion model; returns (boards, forwards each (B,)).

    Each step is one forward of the boards that still have holes, then, board by board, the core's diffusion step
    (sampler.commit, temperature 0: each hole's likeliest digit): it ranks the holes by `order` and fills the
    first `cells_per_step`; with a threshold those at or above it, with an entropy bound the longest run under
    it (at least one either way). Givens never change. callback(event) sees the first board's steps, as the
    samplers' callbacks see theirs (the replay page).
    """
    if type(cells_per_step) is not int or cells_per_step < 1:
        raise UserError(f"cells per step must be an integer >= 1, got {cells_per_step!r}")
    check_rule(order, threshold, entropy_bound)  # the core sampler's own checks
    board = puzzle.clone()
    confidences = torch.full(board.shape, float("inf"), dtype=torch.float64, device=board.device)  # givens: inf
    forwards = torch.zeros(len(board), dtype=torch.long, device=board.device)
    while (open_rows := (board == HOLE).any(1).nonzero()[:, 0]).numel():
        logits = model(board[open_rows], causal=False)  # (open, cells, n)
        for row, b in enumerate(open_rows.tolist()):
            filled = commit(board[b], 0, logits[row], cells_per_step, threshold, 0.0, order, generator,
                            confidences[b], entropy_bound)
            if b == 0 and callback is not None:
                callback({"forward": int(forwards[0]) + 1, "block": 0, "canvas": board[0].clone(), "committed": filled,
                          "confidences": confidences[0]})
        forwards[open_rows] += 1
    return board, forwards


@torch.no_grad()
def solve_ar(model, puzzle):
    """Fill the holes of puzzles (B, cells) with the AR baseline, greedily in reading order: after the puzzle, cell
    by cell, a given copied and a hole the argmax of the next-token logits. Returns (boards, forwards each (B,))."""
    seq, forwards = puzzle, torch.zeros(len(puzzle), dtype=torch.long, device=puzzle.device)
    for cell in range(puzzle.shape[1]):
        given = puzzle[:, cell]  # (B,)
        guess = given
        if (given == HOLE).any():
            guess = torch.where(given == HOLE, model(seq, causal=True)[:, -1].argmax(-1), given)
            forwards += given == HOLE
        seq = torch.cat([seq, guess[:, None]], 1)
    return seq[:, puzzle.shape[1]:], forwards
