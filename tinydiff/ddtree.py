"""DDTree: a draft tree from one DFlash pass, verified in one target forward with an ancestor-only mask.

Paper: "Accelerating Speculative Decoding with Block Diffusion Draft Trees" (Ringel and Romano, 2026,
arXiv 2604.12989). DFlash (tinydiff/dflash.py) verifies one drafted trajectory per round: the
drafter's argmax at every depth. But its one forward gives a whole distribution per depth, so DDTree
spends a node budget on the continuations the drafter finds likeliest and verifies them all at once.
Published: 8.22x over autoregressive decoding vs DFlash's 6.09x (Qwen3-Coder-30B-A3B, HumanEval,
T = 0); tau rises with the budget while the speedup peaks at a middle budget (every node is a row
the target must compute).

Each round, with committed sequence seq (S tokens) and both caches holding seq[:-1]:
  1. draft:   one drafter forward over [seq[-1], MASK x (B-1)] gives logits for depths 1..D;
  2. build:   `build_tree`: per depth the top-K log-probs (K = min(budget, V)); a best-first heap
              over prefixes, scored by the sum of their per-depth log-probs, pops `budget` nodes
              (the drafter's raw log-probs at every temperature: the tree sets tau, never the output);
  3. compile: `compile_tree`: inputs [seq[-1], node tokens], position ids S-1 + depth, and a mask
              where a node sees the committed prefix, its ancestors and itself (never a sibling);
  4. verify:  ONE target forward over the tree (logits and hidden states at every node);
  5. follow:  `follow_tree`: from the root, the target samples its own token at the current node
              (argmax at T = 0); while a child carries that token, step into it; the first sample
              no child carries is the bonus. Each committed token is a target sample given its
              committed prefix, whatever the tree holds (a node's children are distinct tokens, so
              at most one matches): the output is the target's distribution, greedy decoding at T = 0;
  6. commit:  `compact_cache`: the target's K/V rows of the root and the accepted path move into
              place (KVCache.keep), the rest go; the drafter's context grows by the features of the
              same rows, read from the verify forward's hidden states.
Node indices: 0 is the root (the newest committed token, parent -1), 1..N in heap-pop order, so a
parent always precedes its children. Near the end of the context the tree is cut to fit the cache.

The file reads in that order: the tree, the round's steps, the loop (ddtree_generate), the argument checks.
Variants in tinydiff/extras/: trees of sampled children judged by recursive rejection sampling for T > 0
(ddtree_sampled.py), trees whose children read DSpark's Markov head (markov_head.py); --compile compiles
its steps (fast/compiled.py). Leaves out: batches, trees from an AR draft (one forward per depth
and per branch).
"""
import heapq
import time
from dataclasses import dataclass

import torch

from tinydiff.ar import split_time
from tinydiff.checks import UserError
from tinydiff.dflash import draft_block, start_decoding
from tinydiff.model import wide
from tinydiff.sampling import forbid_mask, next_token_probs, sample
from tinydiff.speculative import Tally, cut_at_stop
from tinydiff.tokenizer import EOT


@dataclass
class Tree:
    """A draft tree of N nodes plus the root; every tensor is indexed by node, root = 0."""
    tokens: torch.Tensor      # (N+1,) long: the token at each node; the root's is -1 (the newest committed token)
    depths: torch.Tensor      # (N+1,) long: 0 for the root, 1..D for nodes
    parents: torch.Tensor     # (N+1,) long: the parent's index, -1 for the root
    scores: torch.Tensor      # (N+1,) float64: sum of the drafter's log-probs along the path, 0 at the root
    visibility: torch.Tensor  # (N+1, N+1) bool: row i is True at i's ancestors and i itself

    @property
    def size(self) -> int:
        """N, the number of nodes (the root not counted)."""
        return len(self.tokens) - 1

    def path(self, node: int) -> list[int]:
        """Node indices from depth 1 down to `node` (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]


def build_tree(draft_logits, budget: int) -> Tree:
    """The `budget` highest-scoring prefixes of the drafter's per-depth guesses, as a tree.

    draft_logits (D, V): the drafter's logits for depths 1..D. Each depth keeps its top-K log-probs
    (`draft_logprobs`; K = min(budget, V); ids of probability 0 never enter). A prefix scores the
    sum of its tokens' log-probs, each token read at its own depth: every node at one depth has the
    same candidate children.
    """
    check_tree_args(draft_logits, budget)
    D, V = draft_logits.shape
    top = torch.topk(draft_logprobs(draft_logits), min(budget, V), dim=-1) if D else None  # sorted, best first
    values, ids = (top.values.tolist(), top.indices.tolist()) if D else ([], [])
    return best_first(budget, D, lambda depth, token: (values[depth], ids[depth]))


def draft_logprobs(logits):
    """Log-softmax (..., V) of drafter logits, on the CPU, in float32 (float64 logits: in float64);
    MASK gets -inf when V > MASK, as in next_token_probs: it is never drafted."""
    logp = logits.detach().to(wide(logits.dtype)).cpu()
    return torch.log_softmax(forbid_mask(logp), -1)


def best_first(budget: int, max_depth: int, children) -> Tree:
    """The `budget` best prefixes as a tree. children(depth, token) -> (log-probs, ids), best first:
    the candidate children of a node at `depth` (0..max_depth-1) carrying `token` (-1: the root).
    Heap: start with the root's first child; each pop adds one node and pushes its next sibling
    (same parent, rank + 1) and its first child (rank 0). Both score no more than the node itself,
    so nodes pop in descending score and the first `budget` pops are the best `budget` prefixes;
    each node's parent was popped before it, so the result is a tree.
    """
    tokens, depths, parents, scores = [-1], [0], [-1], [0.0]
    candidates = {}  # node -> its children's (log-probs, ids)
    heap, pushed = [], 0  # entries (-score, push order, parent, rank): ties pop oldest first

    def push(parent, rank):
        nonlocal pushed
        values = candidates[parent][0]
        if rank < len(values) and values[rank] > float("-inf"):
            heapq.heappush(heap, (-(scores[parent] + values[rank]), pushed, parent, rank))
            pushed += 1

    def expand(node):
        if depths[node] < max_depth:
            candidates[node] = children(depths[node], tokens[node])
            push(node, 0)

    expand(0)
    while heap and len(tokens) <= budget:
        neg_score, _, parent, rank = heapq.heappop(heap)
        tokens.append(candidates[parent][1][rank])
        depths.append(depths[parent] + 1)
        parents.append(parent)
        scores.append(-neg_score)
        push(parent, rank + 1)  # next sibling
        expand(len(tokens) - 1)  # first child
    n = len(tokens)
    visibility = torch.zeros(n, n, dtype=torch.bool)
    visibility[0, 0] = True
    for i in range(1, n):  # parents come first: row i = row parent(i) plus i itself
        visibility[i] = visibility[parents[i]]
        visibility[i, i] = True
    return Tree(torch.tensor(tokens), torch.tensor(depths), torch.tensor(parents),
                torch.tensor(scores, dtype=torch.float64), visibility)


def compile_tree(tree: Tree, start: int, root_token: int, device=None):
    """What the target's verify forward takes, given a cache holding `start` committed positions:

    ids (1, N+1): [root_token, node tokens]; pos (N+1,): start + depth (the root sits at `start`);
    mask (N+1, start + N+1) bool: every row sees the whole cached prefix, then its tree row.
    Call `target(ids, pos=pos, mask=mask, cache=cache)`.
    """
    ids = tree.tokens.clone()
    ids[0] = int(root_token)
    pos = start + tree.depths
    prefix = torch.ones(tree.size + 1, start, dtype=torch.bool)
    mask = torch.cat([prefix, tree.visibility], 1)
    return ids[None].to(device), pos.to(device), mask.to(device)


def follow_tree(tree: Tree, target, generator=None):
    """Walk the tree with the target's own samples; returns (path, bonus).

    target: the target's warped probabilities at [root, nodes], (N+1, V) or a function node -> (V,)
    (then only the rows the walk visits are warped), sampled at the visited nodes in order (a
    one-hot row is its argmax and spends no random number); or (N+1,) samples drawn in advance.
    From the root: while one child of the current node carries the target's sample there, step
    into it. path = accepted node indices (root excluded, depth 1 first); bonus = the target's
    sample at the last node reached (the root if none), which none of its children carries.
    """
    if callable(target):
        row = target
    elif target.shape[0] != tree.size + 1:
        raise UserError(f"need the target's answer at the root and all {tree.size} nodes, got {target.shape[0]} rows")
    else:
        row = None if target.dim() == 1 else target.__getitem__
    children = {}  # (parent, token) -> child: siblings carry distinct tokens
    for i in range(1, tree.size + 1):
        children[int(tree.parents[i]), int(tree.tokens[i])] = i
    path, node = [], 0
    while True:
        y = int(target[node]) if row is None else int(sample(row(node), generator))
        child = children.get((node, y))
        if child is None:
            return path, y
        path.append(child)
        node = child


def compact_cache(cache, prefix_len: int, path):
    """Keep the cache's first prefix_len rows, then the tree rows of the root and `path` (node i sits
    at row prefix_len + i), moved into place in order; every other tree row is dropped."""
    rows = list(range(prefix_len)) + [prefix_len + i for i in [0, *path]]
    cache.keep(rows)


def grow_and_verify(target, drafter, target_cache, draft_cache, seq, depth, budget, B, warp_args, grow, judge,
                    tally=None):
    """One round's tree after seq: ONE drafter forward (none when depth is 0), the tree grown to depth
    `depth` (budget nodes at most, fewer where the cache has no room) and compiled, ONE target forward
    over it, the walk. The target's cache then holds the prefix and every tree row (`commit_path`
    compacts it). tally, if given, clocks the stages. Returns (tree, path, bonus, the verify's hidden
    states N x (1, N+1, D))."""
    device = target.embed.weight.device
    t0 = time.perf_counter()
    start = target_cache.length  # the root's position, len(seq) - 1
    if depth:
        logits = draft_block(drafter, draft_cache, seq[-1], block_size=B)[:depth]  # (D, V)
        tree = grow(logits, seq[-1], min(budget, target.config.context - len(seq)))  # S + N rows must fit the cache
    else:
        tree = build_tree(torch.empty(0, 1), 1)  # the root alone: the target's one sample
    ids, pos, mask = compile_tree(tree, start, seq[-1], device)
    t1 = split_time(device)  # drafting: the drafter's forward, the tree grown and compiled
    logits, hidden = target(ids, pos=pos, mask=mask, cache=target_cache, hidden_layers=drafter.config.taps)
    path, bonus = judge(tree, lambda i: next_token_probs(logits[0, i], *warp_args))
    if tally is not None:
        tally.clock(t0, t1, time.perf_counter())  # following the tree read the target's samples back
    return tree, path, bonus, hidden


def commit_path(seq, out, tree, path, bonus, stop_token, target_cache, drafter, draft_cache, hidden):
    """The path's tokens and the bonus, cut after stop_token, appended to seq and out; the target's cache
    compacted to the root and the committed nodes, the drafter's context extended by the same rows'
    features. Returns (tokens, stopped)."""
    start = len(seq) - 1
    tokens = tree.tokens[path].tolist() + [bonus]
    tokens, stopped = cut_at_stop(tokens, stop_token)
    seq += tokens
    out += tokens
    rows = [0, *path][:len(tokens)]  # the tree rows now committed (the newest token is read next round)
    compact_cache(target_cache, start, rows[1:])
    drafter.extend(draft_cache, [h[:, rows] for h in hidden])
    return tokens, stopped


@torch.no_grad()
def ddtree_generate(target, drafter, prompt, max_new_tokens, block_size=None, budget=32, temperature=0.0,
                    top_k=None, top_p=None, generator=None, stop_token=EOT, on_round=None, grow=None, judge=None):
    """Decode after `prompt` (list of ids): each round drafts depths 1..B-1 with one drafter forward,
    verifies a tree of up to `budget` nodes with one target forward and commits 1..B tokens.
    Stops after max_new_tokens (None: fill the context) or after emitting stop_token (None: never;
    tokens after it in the same round are dropped). on_round(info) is called after every round with:
    tree, path (accepted nodes), accepted (their count = depth reached), tokens (committed this
    round), seq (prompt + everything committed), target_cache, draft_cache (both compacted).
    grow(draft_logits (D, V), root_token, n) -> a Tree of at most n nodes (default build_tree) and
    judge(tree, p_at) -> (path, bonus), p_at(node) the target's warped distribution there (default
    follow_tree), are what the variants in tinydiff/extras/ replace.

    Returns (new ids, speculative.Speculated): accepted over the depth reached 0..B-1, proposed = tree
    nodes verified (nodes_per_round: the tree rows each verify forward computes), no rejected or
    alpha (most nodes are alternatives, not a chain's judged drafts), forwards = rounds + the prefill.
    """
    grow = grow or (lambda logits, root_token, n: build_tree(logits, n))
    judge = judge or (lambda tree, p_at: follow_tree(tree, p_at, generator))
    check_budget(budget)
    warp_args = (temperature, top_k, top_p)
    n_new, B, target_cache, draft_cache, prefill = start_decoding(target, drafter, prompt, max_new_tokens, block_size,
                                                                  warp_args)
    seq, out = list(prompt), []
    tally = Tally(B - 1, chain=False, prefill=prefill)
    while len(out) < n_new:
        depth = min(B - 1, n_new - len(out) - 1)  # a full-depth path plus the bonus lands on n_new
        tree, path, bonus, hidden = grow_and_verify(target, drafter, target_cache, draft_cache, seq, depth, budget, B,
                                                    warp_args, grow, judge, tally)
        tokens, stopped = commit_path(seq, out, tree, path, bonus, stop_token, target_cache, drafter, draft_cache,
                                      hidden)
        tally.add(len(path), tree.size, int(depth > 0), int(tree.depths.max()))  # a drafter forward if it drafted
        if on_round is not None:
            on_round({"tree": tree, "path": path, "accepted": len(path), "tokens": tokens, "seq": list(seq),
                      "target_cache": target_cache, "draft_cache": draft_cache})
        if stopped:
            break
    return out, tally.result(out, target.embed.weight.device)


def check_budget(budget):
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise UserError(f"the tree budget (nodes per round) must be an integer >= 1, got {budget!r}")


def check_tree_args(draft_logits, budget):
    check_budget(budget)
    if draft_logits.dim() != 2:
        raise UserError(f"draft_logits must have shape (depths, V), got {tuple(draft_logits.shape)}")
