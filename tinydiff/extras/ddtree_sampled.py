"""DDTree with sampled children, verified by recursive rejection sampling: draft trees for T > 0.

Papers: SpecInfer (Miao et al., 2024; multi-step speculative sampling over a token tree) and Sequoia
(Chen et al., 2024; children sampled without replacement, and a tree shape from positional acceptance
rates). ddtree.py's trees hold the drafter's top-K children and follow the target's own samples, so a
node is kept with probability p(its token): at T = 1, where p is flat, a tree keeps little. Here
a node's children are a sample *without replacement* from q, the drafter's warped distribution at
that node (its depth's logits plus, with DSpark's Markov head, the bias of the node's own token),
and the target judges them in the order they were drawn (`follow_sampled_tree`):

    R = p (the target's warped distribution at the node), Q = q
    for each child x, in draw order:
        with probability min(1, R(x) / Q(x)): accept x, step into it and judge its children the same way
        else: R = norm(max(R - Q, 0)); Q(x) = 0, Q = norm(Q)   (Q: the law of the next draw)
    no child accepted, or a leaf reached: the bonus is a sample of R

Each step is speculative sampling of R with the proposal Q, so a node's output follows R whatever Q
is; by induction on the children, and then on the depth, every committed token is the target's
sample given its committed prefix: lossless. That needs each child to be a fresh draw from Q, so
whether a child exists must never depend on the token drawn into it.

Shape (Sequoia's positional rule): a_k is the chance that a node's k-th drawn child is the one
accepted; a prefix scores the product of a over its ranks and `best_first` keeps the `budget` best.
Scores read ranks only, never tokens, which is the condition above. `RankAcceptance` estimates a
from the rounds verified so far (accepted / tested per rank, from a flat prior): a round's shape is
fixed before its draws and its verify, so it cannot bias that round. At T = 0 a sample of a one-hot q
is its argmax, one child per node; `ddtree_sampled_generate` then runs ddtree_generate, whose top-K
tree is the greedy optimum.

Leaves out: Sequoia's hardware-aware depth and budget search, SpecTr's optimal-transport verify, and
shapes that read the drafter's confidence per node (they must not read a child's own token).
"""
import math
import sys

import torch

from tinydiff.checks import COUNT, UserError
from tinydiff.ddtree import Tree, best_first, check_budget, ddtree_generate
from tinydiff.extras.dflash_reject import drafts_per_round
from tinydiff.io.checkpoint import AR_KINDS, drafter_from, load_checkpoint
from tinydiff.io.cli import run_main, story_parser, write_story
from tinydiff.sampling import next_token_probs, residual, sample
from tinydiff.tokenizer import EOT


class RankAcceptance:
    """Sequoia's positional acceptance, counted: tested[k] nodes judged their k-th child (k = 0, 1, ..),
    accepted[k] of them accepted it. b_k = (accepted + 1) / (tested + 2) is the chance the k-th child
    is accepted once the ones before it were rejected; a_k = b_k * prod_{j<k} (1 - b_j)."""

    def __init__(self, ranks: int):
        self.tested, self.accepted = [0] * ranks, [0] * ranks

    def log_rates(self) -> list[float]:
        """log a_k for k = 0..ranks-1, the chance the k-th child is the one accepted. In logs because a_k
        halves with each rank under the flat prior: past about 1,075 ranks a float a_k would be 0."""
        out, log_reach = [], 0.0
        for tested, accepted in zip(self.tested, self.accepted):
            b = (accepted + 1) / (tested + 2)  # in (0, 1): the prior keeps it off both ends
            out.append(log_reach + math.log(b))
            log_reach += math.log1p(-b)
        return out

    def update(self, tree, path):
        """Count one verified round: each node on the walk (the root, then `path`) tested its children
        in order up to the accepted one (the next node on the path), or all of them."""
        kids = children_in_order(tree)
        for node, taken in zip([0, *path], [*path, None]):
            for rank, child in enumerate(kids[node][:len(self.tested)]):
                self.tested[rank] += 1
                if child == taken:
                    self.accepted[rank] += 1
                    break


def children_in_order(tree) -> dict:
    """node -> its children's indices in draw order (best_first creates a node's children in rank order)."""
    kids = {i: [] for i in range(tree.size + 1)}
    for i in range(1, tree.size + 1):
        kids[int(tree.parents[i])].append(i)
    return kids


def draws_without_replacement(q, n: int, generator=None) -> list[int]:
    """The first n draws (at most q's support) of sampling without replacement from q (V,), in draw
    order: each a sample of q renormalised over the ids not yet drawn."""
    draws = []
    for _ in range(min(n, int((q > 0).sum()))):
        if draws:
            q = q.clone()
            q[draws[-1]] = 0
        draws.append(int(sample(q / q.sum(), generator)))
    return draws


def node_distributions(draft_logits, head, root_token: int, warp_args):
    """q(depth, token): the drafter's warped distribution (V,) for the children of a node at `depth`
    (0 = the root) carrying `token` (-1: the root, whose token is root_token). Without a head it reads
    the depth's logits alone; with DSpark's Markov head, those plus the bias of the node's token.
    Memoised: nodes of one depth holding one token share it."""
    memo = {}

    @torch.no_grad()
    def q(depth, token):
        key = (depth, token if head is not None else None)
        if key not in memo:
            row = draft_logits[depth]
            if head is not None:
                previous = torch.tensor(root_token if token < 0 else token, device=row.device)
                row = row + head(previous).to(row.dtype)
            memo[key] = next_token_probs(row, *warp_args)
        return memo[key]
    return q


def rank_shape(log_rates, max_depth: int, budget: int):
    """The shape: a Tree of up to `budget` nodes and depth <= max_depth holding the `budget` best
    prefixes of ranks (0 = a node's first child) under the per-rank log rates, a prefix scored by the sum
    of its ranks' (Tree.scores); its tokens are the ranks, until `fill` draws real ones."""
    check_budget(budget)
    log_rates = list(log_rates[:budget])
    return best_first(budget, max_depth, lambda depth, token: (log_rates, list(range(len(log_rates)))))


def fill(shape, q, generator=None):
    """The shape with each node's children drawn without replacement from q(depth, token) of that node,
    parents first (node order). Where q's support is smaller than a node's children, the children
    past it (and their subtrees) are dropped: whether they exist reads q, never their own tokens."""
    kids = children_in_order(shape)
    tokens, keep = shape.tokens.clone(), [True] * (shape.size + 1)
    for node in range(shape.size + 1):
        if keep[node] and kids[node]:
            draws = draws_without_replacement(q(int(shape.depths[node]), int(tokens[node])), len(kids[node]), generator)
            tokens[kids[node][:len(draws)]] = torch.tensor(draws, dtype=tokens.dtype)
            for child in kids[node][len(draws):]:
                keep[child] = False
        elif not keep[node]:
            for child in kids[node]:
                keep[child] = False
    return subtree(shape, tokens, keep)


def subtree(shape, tokens, keep):
    """The Tree of the kept nodes (ancestor-closed) with `tokens`, renumbered in order."""
    kept = [i for i in range(shape.size + 1) if keep[i]]
    index = {old: new for new, old in enumerate(kept)}
    parents = torch.tensor([-1] + [index[int(shape.parents[i])] for i in kept[1:]])
    return Tree(torch.cat([torch.tensor([-1]), tokens[kept[1:]]]), shape.depths[kept], parents, shape.scores[kept],
                shape.visibility[kept][:, kept])


def build_sampled_tree(q, log_rates, max_depth: int, budget: int, generator=None):
    """`rank_shape` filled with draws: the tree a round verifies. Only nodes with children read q."""
    return fill(rank_shape(log_rates, max_depth, budget), q, generator)


def follow_sampled_tree(tree, p_at, q, generator=None):
    """The recursive rejection walk (module docstring); returns (path, bonus) as follow_tree does.
    p_at(node) -> the target's warped distribution (V,) at that node; q(depth, token) -> the one the
    node's children were drawn from."""
    kids = children_in_order(tree)
    path, node = [], 0
    while True:
        r = p_at(node).double()
        if kids[node]:  # a leaf (the deepest depth, maybe) has no q
            proposal = q(int(tree.depths[node]), int(tree.tokens[node])).double()
        for child in kids[node]:
            x = int(tree.tokens[child])
            if float(torch.rand((), generator=generator, dtype=torch.float64)) * proposal[x] < r[x]:
                break  # accepted: u < R(x) / Q(x)
            r = residual(r, proposal)
            proposal = proposal.clone()
            proposal[x] = 0
            proposal = proposal / proposal.sum()
        else:
            return path, int(sample(r, generator))
        path.append(child)
        node = child


@torch.no_grad()
def ddtree_sampled_generate(target, drafter, prompt, max_new_tokens, block_size=None, budget=32, temperature=1.0,
                            top_k=None, top_p=None, generator=None, stop_token=EOT, on_round=None, acceptance=None):
    """ddtree_generate's loop, arguments and result, with sampled trees judged by recursive rejection
    sampling. acceptance: a RankAcceptance to shape the trees with and keep counting into (default: a
    fresh one with `budget` ranks); it is updated after every round. At temperature 0, ddtree_generate."""
    if temperature == 0:
        return ddtree_generate(target, drafter, prompt, max_new_tokens, block_size, budget, temperature, top_k, top_p,
                               generator, stop_token, on_round)
    if acceptance is not None and not isinstance(acceptance, RankAcceptance):
        raise UserError(f"acceptance must be a RankAcceptance, got {type(acceptance).__name__}")
    check_budget(budget)
    budget = min(budget, max(1, target.config.context - len(prompt)))  # a tree's rows fit the cache: no round has more
    acceptance = RankAcceptance(budget) if acceptance is None else acceptance
    warp_args, distributions = (temperature, top_k, top_p), {}

    def grow(logits, root_token, n):
        distributions["q"] = node_distributions(logits, getattr(drafter, "markov", None), root_token, warp_args)
        return build_sampled_tree(distributions["q"], acceptance.log_rates(), len(logits), n, generator)

    def judge(tree, p_at):  # a root alone (no draft: the last token) reads no q, and its walk is p's one sample
        path, bonus = follow_sampled_tree(tree, p_at, distributions.get("q"), generator)
        acceptance.update(tree, path)
        return path, bonus
    return ddtree_generate(target, drafter, prompt, max_new_tokens, block_size, budget, *warp_args, generator,
                           stop_token, on_round, grow=grow, judge=judge)


def tree_budget(budget, target, prompt) -> int:
    """--budget as a round can use it (None: 32): a tree's rows sit in the target's cache after the prompt, so no
    round verifies more than the context's room; a larger --budget does what that does, clamped with a one-line
    notice on stderr (the default's clamp goes unsaid)."""
    room = max(1, target.config.context - len(prompt))
    if budget is not None and budget > room:
        print(f"notice: --budget {budget} is more than the {room} tree nodes the context has room for after this "
              f"prompt; verifying at most {room} a round", file=sys.stderr)
    return min(32 if budget is None else budget, room)


def main(argv=None):
    """python -m tinydiff.extras.ddtree_sampled: DDTree at T > 0, sampled children judged by recursive rejection."""
    p = story_parser("python -m tinydiff.extras.ddtree_sampled", "DDTree with sampled children judged by "
                     "recursive rejection sampling (lossless; for temperature > 0).")
    p.add_argument("--draft", required=True, help="the DFlash drafter (train.py --model dflash)")
    p.add_argument("--k", type=COUNT, help="the tree's depth (default: the drafter's block - 1)")
    p.add_argument("--budget", type=COUNT, help="tree nodes verified per round (default 32)")
    args = p.parse_args(argv)

    def decode(target, prompt, generator):
        drafter = drafter_from(load_checkpoint(args.draft, kinds=("dflash",)), target, args.draft)
        block = drafts_per_round(args.k, drafter)
        return ddtree_sampled_generate(target, drafter, prompt, args.max_new_tokens, block,
                                       tree_budget(args.budget, target, prompt),
                                       0.8 if args.temperature is None else args.temperature, generator=generator)
    write_story(args, AR_KINDS, decode)


if __name__ == "__main__":
    sys.exit(run_main(main))
