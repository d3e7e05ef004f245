"""The pieces of train.py's loop that are not the loop: optimizer, schedule, validation.

AdamW with betas (0.9, 0.95), weight decay on matrices only (never on norms), and a learning rate
that warms up linearly to `lr` and then follows a cosine down to `min_lr` at `max_steps` (nanoGPT's).
Validation averages each stat of the run's loss over fixed batches and fixed noise.
"""
import math

import torch


def lr_at(step: int, run: dict) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at max_steps."""
    if step < run["warmup"]:
        return run["lr"] * (step + 1) / run["warmup"]
    progress = (step - run["warmup"]) / max(1, run["max_steps"] - run["warmup"])
    return run["min_lr"] + 0.5 * (run["lr"] - run["min_lr"]) * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_optimizer(model, run: dict):
    """AdamW; weight decay on matrices only, never on norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": run["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=run["lr"], betas=(0.9, 0.95))


@torch.no_grad()
def evaluate(model, loss_fn, windows, batch_size: int, autocast) -> dict:
    """Mean of each stat over fixed validation windows and fixed noise (the same every time)."""
    model.eval()
    totals = {}
    generator = torch.Generator(windows.device).manual_seed(0)
    for i in range(0, len(windows), batch_size):
        with autocast:
            _, stats = loss_fn(model, windows[i:i + batch_size], generator)
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + float(v) * len(windows[i:i + batch_size])
    model.train()
    return {k: v / len(windows) for k, v in totals.items()}
