"""Spec: the Sudoku corpus and its solvers (tinydiff/extras/sudoku.py), and the trainer that makes lesson 16's models
(tinydiff/extras/sudoku_train.py). Grids are valid and seeded; puzzles held out keep one solution; the checker refuses
each kind of broken board; every order of the core's sampler fills one hole a step and never a given; the margin rule
picks the cell a hand computation picks; a solve rate is a hand count; the trainer refuses bad input in one line."""
import math

import pytest
import torch
from entry_points import last_line, run_in_process
from hostile import refused

from tinydiff.checks import UserError
from tinydiff.extras import sudoku_train
from tinydiff.extras.sudoku import (
    HELD_OUT,
    HOLE,
    SEEDS,
    Board,
    bases,
    count_solutions,
    grids,
    held_out,
    solutions,
    solve,
    solve_ar,
    solved,
    sudoku_model,
    training_grids,
    unique_puzzles,
)
from tinydiff.sampler import REMASKING, commit

SMALL = Board(2, 2)  # 4x4: 288 grids in all, small enough to count by hand
SIX = Board(2, 3)


@pytest.mark.parametrize("board", [SMALL, SIX, Board(3, 3), Board(3, 2)])
def test_grids_are_valid_and_seeded(board):
    base = bases(board)
    made = grids(board, 200, base, torch.Generator().manual_seed(5))
    assert made.shape == (200, board.cells) and solved(board, made, made).all() and solved(board, base, base).all()
    assert torch.equal(made, grids(board, 200, base, torch.Generator().manual_seed(5)))
    assert not torch.equal(made, grids(board, 200, base, torch.Generator().manual_seed(6)))
    if board != SMALL:
        assert len({tuple(g) for g in made.tolist()}) > 190  # many grids, not one grid's few
    else:
        assert len({tuple(g) for g in grids(board, 5000, base, torch.Generator().manual_seed(5)).tolist()}) == 288


def test_the_solution_counter_counts_the_288_4x4_grids_and_a_unique_puzzles_one():
    assert count_solutions(SMALL, [HOLE] * 16, limit=1000) == 288
    grid = bases(SIX)[0].tolist()
    puzzle = unique_puzzles(SIX, torch.tensor([grid]), 27, seed=0)[0].tolist()
    assert puzzle.count(HOLE) == 27 and count_solutions(SIX, puzzle) == 1 and next(solutions(SIX, puzzle)) == grid


def test_held_out_puzzles_have_one_solution_are_seeded_and_never_trained_on():
    puzzle, grid = held_out(SIX, 8, 27)
    assert ((puzzle == HOLE).sum(1) == 27).all() and ((puzzle == HOLE) | (puzzle == grid)).all()
    assert all(count_solutions(SIX, p) == 1 for p in puzzle.tolist())
    assert torch.equal(held_out(SIX, 3, 27)[0], puzzle[:3])  # a larger count only adds puzzles
    # a training draw from the held-out grids' own random stream would be exactly those grids: all are dropped
    same_stream = torch.Generator().manual_seed(SEEDS["held-out grids"])
    assert len(training_grids(SIX, same_stream)(HELD_OUT)) == 0
    assert len(training_grids(SIX, torch.Generator().manual_seed(9))(64)) >= 62
    with pytest.raises(UserError, match="one solution and 30 holes"):
        unique_puzzles(SIX, grid[:1], 30, seed=0, tries=2)


def test_the_checker_refuses_a_repeat_in_a_row_a_column_a_box_and_a_changed_given():
    valid = torch.tensor([[0, 1, 2, 3], [2, 3, 0, 1], [1, 0, 3, 2], [3, 2, 1, 0]]).flatten()
    columns_broken = torch.tensor([[0, 1, 2, 3], [2, 3, 0, 1], [0, 1, 2, 3], [2, 3, 0, 1]])  # rows, boxes fine
    rows_broken = columns_broken.T  # columns, boxes fine
    boxes_broken = torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1], [3, 0, 1, 2]])  # a Latin square
    empty = torch.full((16,), HOLE)
    boards = torch.stack([valid, columns_broken.flatten(), rows_broken.flatten(), boxes_broken.flatten()])
    assert solved(SMALL, boards, empty.expand(4, -1)).tolist() == [True, False, False, False]
    other = torch.tensor([[1, 0, 3, 2], [3, 2, 1, 0], [0, 1, 2, 3], [2, 3, 0, 1]]).flatten()  # valid, every cell else
    assert solved(SMALL, other[None], other[None]).item()
    given = empty.clone()
    given[5] = valid[5]
    assert solved(SMALL, valid[None], given[None]).item() and not solved(SMALL, other[None], given[None]).item()
    assert not solved(SMALL, torch.where(torch.arange(16) == 3, HOLE, valid)[None], empty[None]).item()  # a hole left


@pytest.mark.parametrize("order", REMASKING)
def test_each_order_fills_exactly_one_hole_a_step_and_never_a_given(order):
    torch.manual_seed(0)
    model = sudoku_model(SIX, causal=False, n_layer=1, d_model=16, d_ff=32).eval()
    puzzle, _ = held_out(SIX, 2, 27)
    events = []
    boards, forwards = solve(model, puzzle, order, generator=torch.Generator().manual_seed(1), callback=events.append)
    assert forwards.tolist() == [27, 27] and len(events) == 27 and not (boards == HOLE).any()
    before = puzzle[0]
    for event in events:  # board 0, step by step
        changed = (event["canvas"] != before).nonzero()[:, 0].tolist()
        assert changed == event["committed"] and len(changed) == 1 and before[changed[0]] == HOLE
        before = event["canvas"]
    given = puzzle != HOLE
    assert torch.equal(boards[given], puzzle[given])
    if order == "left_to_right":  # reading order: the holes in turn
        assert [e["committed"][0] for e in events] == (puzzle[0] == HOLE).nonzero()[:, 0].tolist()


def test_the_margin_rule_picks_the_hole_whose_two_likeliest_digits_lie_furthest_apart():
    """Holes at cells 1 and 2 (cell 0 given). Cell 1: p = (0.6, 0.4, 0), the surest top digit, margin 0.2, entropy
    0.67 nats; cell 2: p = (0.5, 0.25, 0.25), margin 0.25, entropy 1.04. The margin fills cell 2 (digit 0); the
    highest probability and the lowest entropy fill cell 1."""
    probs = torch.tensor([[1.0, 0, 0], [0.6, 0.4, 0], [0.5, 0.25, 0.25]], dtype=torch.float64)
    logits = probs.clamp(min=1e-12).log()
    picks = {}
    for order in ("top_margin", "low_confidence", "low_entropy"):
        canvas = torch.tensor([2, HOLE, HOLE])
        confidences = torch.full((3,), math.inf, dtype=torch.float64)
        picks[order] = commit(canvas, 0, logits, 1, None, 0.0, order, None, confidences)
        if order == "top_margin":
            assert canvas.tolist() == [2, HOLE, 0] and confidences[2].item() == pytest.approx(0.25)
    assert picks == {"top_margin": [2], "low_confidence": [1], "low_entropy": [1]}


class Answers(torch.nn.Module):
    """A stand-in model that is sure of one board per puzzle: its logits put 20 nats on `boards`' digits."""

    def __init__(self, boards, n):
        super().__init__()
        self.logits = 20.0 * torch.nn.functional.one_hot(boards, n).double()

    def forward(self, ids, causal):
        return self.logits[:len(ids)]


def test_a_solve_rate_is_the_hand_count_of_solved_puzzles():
    """Three puzzles: the model writes the solution of the first and third, and a repeated digit into the second."""
    puzzle, grid = held_out(SIX, 3, 27)
    wrong = grid[1].clone()
    hole = (puzzle[1] == HOLE).nonzero()[0, 0]
    wrong[hole] = (wrong[hole] + 1) % SIX.n  # one hole, one digit off: a repeat in its row
    answers = Answers(torch.stack([grid[0], wrong, grid[2]]), SIX.n)
    boards, _ = solve(answers, puzzle, "top_margin")
    assert solved(SIX, boards, puzzle).tolist() == [True, False, True]
    assert sudoku_train.rate(SIX, puzzle, lambda p: solve(answers, p, "top_margin")) == (pytest.approx(2 / 3), 27.0)


def test_the_ar_solver_copies_the_givens_and_a_cell_embeds_the_same_in_the_puzzle_and_the_answer():
    torch.manual_seed(0)
    model = sudoku_model(SIX, causal=True, n_layer=1, d_model=16, d_ff=32).eval()
    puzzle, _ = held_out(SIX, 2, 27)
    boards, forwards = solve_ar(model, puzzle)
    given = puzzle != HOLE
    assert torch.equal(boards[given], puzzle[given]) and not (boards == HOLE).any() and forwards.tolist() == [27, 27]
    seq = torch.cat([puzzle, puzzle], 1)  # (2, 72): the answer's cell i is position 36 + i
    x = model.embed(seq)
    assert torch.equal(x[:, :36], x[:, 36:]) and not torch.equal(x[:, 0], x[:, 1])
    units = SIX.units()  # hand-checked: cell 7 is row 1, column 1, box 0; cell 20 row 3, column 2, box 2
    assert units[7].tolist() == [1, 1, 0] and units[20].tolist() == [3, 2, 2] and units[35].tolist() == [5, 5, 5]


def test_the_trainer_saves_both_models_that_load_and_refuses_a_second_run_into_the_folder(tmp_path, capsys):
    res = run_in_process(sudoku_train.main, "--out", tmp_path / "run", "--minutes", 0.005, "--puzzles", 3,
                         "--d-model", 16, "--n-layer", 1)
    assert res.returncode == 0, res.stderr
    assert "3 held-out puzzles, 6x6, 27 holes" in res.stdout and "fewest forwards within 2 points" in res.stdout
    for kind in ("mdlm", "ar"):
        model, ckpt = sudoku_train.load(tmp_path / "run" / f"{kind}.pt", kind)
        assert ckpt["step"] >= 1 and ckpt["board"] == [2, 3] and model.config.causal == (kind == "ar")
    with pytest.raises(UserError, match="holds a sudoku-mdlm model; this needs sudoku-ar"):
        sudoku_train.load(tmp_path / "run" / "mdlm.pt", "ar")
    line = refused(sudoku_train.main, ["--out", tmp_path / "run", "--minutes", 0.005], capsys, tmp_path)
    assert "already holds mdlm.pt" in line


@pytest.mark.parametrize("flags, message", [
    (["--board", "2x5"], "--board must be BOX_ROWSxBOX_COLS, each 2 to 4"),
    (["--board", "1x1"], "--board must be BOX_ROWSxBOX_COLS, each 2 to 4"),
    (["--board", "three"], "--board must be BOX_ROWSxBOX_COLS"),
    (["--holes", 36], "--holes must leave some givens"),
    (["--puzzles", 1001], "--puzzles"),
    (["--minutes", "nan"], "--minutes"),
    (["--d-model", 20], "--d-model must be a multiple of 8"),
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "tpu"], "--device"),
])
def test_the_trainer_refuses_bad_flags_in_one_line_before_any_work(tmp_path, capsys, flags, message):
    line = refused(sudoku_train.main, ["--out", tmp_path / "run", *flags], capsys, tmp_path)
    assert message in line and not (tmp_path / "run").exists()


def test_a_damaged_sudoku_checkpoint_is_one_line(tmp_path):
    from tinydiff.io.checkpoint import save_checkpoint
    model = sudoku_model(SIX, causal=False, n_layer=1, d_model=16, d_ff=32)
    for board, message in (([9, 9], "its board is not"), ([3, 3], "does not fit a mdlm model of a 9x9 board")):
        save_checkpoint(tmp_path / "m.pt", kind="sudoku-mdlm", config=model.config, model=model, board=board)
        with pytest.raises(UserError, match=message):
            sudoku_train.load(tmp_path / "m.pt", "mdlm")
    big = {**model.config.__dict__, "d_model": 4096}  # a config past its weights: refused before it is built
    torch.save({"format": "tinydiff-checkpoint", "version": 2, "kind": "sudoku-mdlm", "config": big,
                "model": model.state_dict(), "board": [2, 3]}, tmp_path / "big.pt")
    with pytest.raises(UserError, match="weights do not fit its config"):
        sudoku_train.load(tmp_path / "big.pt", "mdlm")
    res = run_in_process(sudoku_train.main, "--out", tmp_path / "m.pt")
    assert res.returncode == 1 and "is a file, not a folder" in last_line(res.stderr)


@pytest.mark.parametrize("rule, message", [({"order": "diagonal"}, "remasking must be one of"),
                                           ({"cells_per_step": 0}, "cells per step must be an integer >= 1"),
                                           ({"threshold": 1.5}, "threshold must lie in"),
                                           ({"entropy_bound": -1.0}, "entropy bound must be"),
                                           ({"threshold": 0.9, "entropy_bound": 0.1}, "not both")])
def test_solve_refuses_a_rule_the_sampler_would_refuse(rule, message):
    model = sudoku_model(SIX, causal=False, n_layer=1, d_model=16, d_ff=32)
    with pytest.raises(UserError, match=message):
        solve(model, torch.full((1, SIX.cells), HOLE), **rule)
