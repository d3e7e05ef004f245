"""A DDTree round as one compiled graph: the block drafted, the tree built, verified, followed and compacted.

ddtree.py grows its tree on the host (a heap over Python lists), compiles it into ids, positions and
an ancestor mask, and walks it with one read-back per node it visits; only the two forwards are
compiled steps. `ddtree_round` does DDTree's four functions on the device, with fixed shapes for a
budget of N nodes and D = B - 1 depths:
  build:   `build_tree_static`: the same best-first search as ddtree.best_first, N pops from a
           buffer of 2N + 1 candidate slots: slot 0 holds the root's first child, the j-th pop (from
           0) writes the popped node's next sibling into slot 2j + 1 and its first child into 2j + 2. The
           argmax over the slots' scores takes the first of equal ones, the oldest push, as the
           heap's (score, push order) does, so the tree is ddtree.build_tree's node for node. A pop
           from an empty buffer (every candidate -inf) is an invalid node: no row sees it, none
           follows it;
  compile: ids, positions start + depth and the mask (N+1, C): the committed rows, then each
           node's ancestors and itself;
  follow:  the target's pick at every node (argmax, or an inverse-CDF draw with the uniform of the
           node's depth: the walk visits one node per depth, in depth order); a node is on the path
           when its parent is and it carries the parent's pick; D vectorised steps;
  compact: the target's rows of the root and the path moved to the rows after the prefix, and the
           drafter's context extended by their features.
The host reads back one small tensor a round: the path's tokens, its length, the bonus, the tree's
size and depth. At T > 0 the walk spends one number per visited node, a count the graph only learns:
the loop draws D + 1, then rewinds the generator and spends path + 1 (fused_dflash.py's device).
(`sampling.sample` spends none on an exactly one-hot row at T > 0, the graph does; both exact draws.)
Rounds whose rows would pass the context run ddtree.py's eager pieces on the static models.

Leaves out: trees built through a Markov head (ddtree.build_markov_tree: a top-k over V per node),
sampled trees judged by recursive rejection (ddtree_sampled.py), batches.
"""
import torch

from tinydiff.checks import UserError
from tinydiff.ddtree import build_tree, check_budget, commit_path, follow_tree, grow_and_verify
from tinydiff.dflash import check_drafter, commit, start_decoding
from tinydiff.fast.compiled import Compiled, StaticDrafter, StaticModel, static_forward
from tinydiff.fast.fused_dflash import draft_block_static, target_picks
from tinydiff.fast.fused_round import RewindableDraws
from tinydiff.kernels import kernels_enabled
from tinydiff.sampling import draftable
from tinydiff.speculative import Tally
from tinydiff.tokenizer import EOT


def build_tree_static(logits, budget: int, depth_limit):
    """ddtree.build_tree on the device: logits (D, V), depth_limit () the deepest depth that may grow.

    Returns, per node (root = 0, then N = budget pops): tokens (N+1,) (the root's 0), depths (N+1,),
    parents (N+1,) (the root's 0), valid (N+1,) bool and visibility (N+1, N+1) bool (row i: i's
    ancestors and i; an invalid node sees only itself)."""
    D, V = logits.shape
    K = min(budget, V)
    # MASK never drafted, in float32 at least: ddtree.draft_logprobs
    values, ids = torch.topk(torch.log_softmax(draftable(logits), -1), K, dim=-1)  # (D, K) each, best first
    values = values.double()  # scores add in float64, as the heap's Python floats
    device, N = logits.device, budget
    slots = 2 * N + 1
    cand_score = torch.full((slots,), float("-inf"), dtype=torch.float64, device=device)
    cand_parent = torch.zeros(slots, dtype=torch.long, device=device)
    cand_rank = torch.zeros(slots, dtype=torch.long, device=device)
    depths = torch.zeros(N + 1, dtype=torch.long, device=device)
    parents = torch.zeros(N + 1, dtype=torch.long, device=device)
    tokens = torch.zeros(N + 1, dtype=torch.long, device=device)
    scores = torch.zeros(N + 1, dtype=torch.float64, device=device)
    flat_values, flat_ids = values.view(-1), ids.view(-1)  # (D * K,): row r, rank k at r * K + k
    # Every index below is a (1,) tensor read with index_select: a 0-d one would be a data-dependent
    # Python index to the compiler (and selects a view, which the pop would overwrite).
    cand_score[:1] = torch.where(depth_limit > 0, flat_values[:1], float("-inf"))  # the root's first child
    for i in range(1, N + 1):
        s = cand_score.argmax().view(1)  # (1,): the best candidate, the oldest of equal ones
        score, parent, rank = (t.index_select(0, s) for t in (cand_score, cand_parent, cand_rank))  # (1,) each
        row = depths.index_select(0, parent)  # (1,): the parent's depth, the row its children come from
        ok = score > float("-inf")  # (1,): else the buffer was empty, an invalid node
        cand_score.index_fill_(0, s, float("-inf"))
        depths[i:i + 1] = row + 1
        parents[i:i + 1] = parent
        tokens[i:i + 1] = flat_ids.index_select(0, row.clamp_max(D - 1) * K + rank.clamp_max(K - 1))
        scores[i:i + 1] = score
        sibling = rank + 1  # the popped node's next sibling: same parent, one rank down
        value = flat_values.index_select(0, row.clamp_max(D - 1) * K + sibling.clamp_max(K - 1))
        cand_score[2 * i - 1:2 * i] = torch.where(ok & (sibling < K), scores.index_select(0, parent) + value,
                                                  float("-inf"))
        cand_parent[2 * i - 1:2 * i], cand_rank[2 * i - 1:2 * i] = parent, sibling
        value = flat_values.index_select(0, (row + 1).clamp_max(D - 1) * K)  # its first child: rank 0, one deeper
        cand_score[2 * i:2 * i + 1] = torch.where(ok & (row + 1 < depth_limit), score + value, float("-inf"))
        cand_parent[2 * i] = i
    valid = torch.cat([torch.ones(1, dtype=torch.bool, device=device), scores[1:] > float("-inf")])
    # Row i: i itself and its parent's row, D times over (a node lies at most D deep). In uint8: inductor's
    # vectorised C++ for these bool products does not compile (torch 2.13).
    own, keep = torch.eye(N + 1, dtype=torch.uint8, device=device), valid.to(torch.uint8)[:, None]
    visibility = own
    for _ in range(D):
        visibility = torch.maximum(own, visibility.index_select(0, parents) * keep)
    return tokens, depths, parents, valid, visibility.bool()


def ddtree_round(target, drafter, target_cache, draft_cache, idx, start, depth_limit, u, budget: int, warp_args):
    """One round of ddtree_generate (the module docstring's steps) after a sequence whose newest token is
    idx (1,) at position start (1,); both caches hold the rows before it. depth_limit (): how deep the
    tree may grow (B - 1, less in a story's last rounds); u (B, 1) float64: the walk's uniform for each
    depth (unread when greedy). Returns (D + 4,): the path's tokens by depth (D, the first n of them on
    the path), n, the bonus, the tree's node count and its depth."""
    B = len(u)
    D = B - 1
    logits, at = draft_block_static(drafter, draft_cache, idx, start, B)  # (D, V), (B,): the block's positions
    tokens, depths, parents, valid, visibility = build_tree_static(logits, budget, depth_limit)
    # compile: [the newest token, the nodes] at start + depth, rows start..start + N
    x = torch.cat([idx, tokens[1:]])[None]  # (1, N+1)
    rows = start + torch.arange(budget + 1, device=idx.device)  # (N+1,)
    cached = torch.arange(target_cache.capacity, device=idx.device)[None] < start  # (1, C): the prefix
    tree_rows = torch.zeros(budget + 1, target_cache.capacity, dtype=torch.bool, device=idx.device)
    tree_rows = tree_rows.index_copy(1, rows, visibility)  # (N+1, C): each node's ancestors and itself
    logits, hidden = static_forward(target, target_cache, x, start + depths, rows, cached | tree_rows)
    # follow: the target's pick at every node; a node is on the path when its parent is and carries that pick
    y = target_picks(logits[0], warp_args, u.index_select(0, depths.clamp_max(D)))  # (N+1,)
    on_path = (torch.arange(budget + 1, device=idx.device) == 0).to(torch.uint8)  # (N+1,): the root (uint8: as above)
    carries = valid.to(torch.uint8) * (tokens == y.index_select(0, parents)).to(torch.uint8)  # (N+1,)
    for _ in range(D):
        on_path = torch.maximum(on_path, on_path.index_select(0, parents) * carries)
    on_path = on_path.bool()
    n = on_path.sum() - 1  # (): nodes accepted below the root
    last = (on_path * (depths + 1)).argmax().view(1)  # (1,): the deepest node on the path
    at_depth = on_path[None] & (depths[None] == torch.arange(1, B, device=idx.device)[:, None])  # (D, N+1)
    path = at_depth.long().argmax(-1)  # (D,): the path's node at each depth (0 past its end)
    # compact: the root and the path to the rows after the prefix, and their features into the drafter's context
    kept = torch.cat([rows[:1], rows.index_select(0, path)])  # (B,): their rows now
    for layer in range(len(target_cache.k)):
        target_cache.write(layer, at, target_cache.k[layer].index_select(2, kept),
                           target_cache.v[layer].index_select(2, kept))
    picked = kept - start  # (B,): their tree indices
    features = drafter.features([hidden[i].index_select(1, picked) for i in drafter.config.taps])  # (1, B, D)
    for layer, (k, v) in enumerate(drafter.context_kv(features, at)):
        draft_cache.write(layer, at, k, v)
    size, height = valid.sum() - 1, (depths * valid).max()
    return torch.cat([tokens.index_select(0, path), torch.stack([n, y.index_select(0, last)[0], size, height])])


class FusedDDTree:
    """A target (StaticModel) and a DFlash drafter without a Markov head (StaticDrafter) whose rounds of
    trees of `budget` nodes over blocks of `block_size` (default the drafter's) run as one compiled
    ddtree_round (with `compile`: True, a COMPILE_MODES name, or False for eager). The wrappers read the
    prompt and run the rounds at the context's end."""

    def __init__(self, target: StaticModel, drafter: StaticDrafter, budget: int = 32, block_size=None, compile=True):
        if not isinstance(target, StaticModel) or not isinstance(drafter, StaticDrafter):
            raise UserError("a fused DDTree round needs the target as a StaticModel and the drafter as a StaticDrafter")
        if drafter.markov is not None:
            raise UserError("a fused DDTree round builds plain trees; a drafter with a Markov head decodes with "
                            "ddtree_generate (its trees read the head at every node)")
        check_budget(budget)
        self.target, self.drafter, self.budget = target, drafter, budget
        self.block_size = check_drafter(target, drafter, block_size)
        self.round = Compiled(lambda *a: ddtree_round(target.module, drafter.module, *a), target.embed.weight.device,
                              (budget,), compile)

    @property
    def compile_seconds(self) -> float:
        return self.target.compile_seconds + self.drafter.compile_seconds + self.round.compile_seconds

    def rows(self) -> int:
        """The rows a round writes after the prefix: the tree's (N + 1), the compacted path's (B)."""
        return max(self.budget + 1, self.block_size)

    def fits(self, target_cache, draft_cache, seq) -> bool:
        return len(seq) - 1 + self.rows() <= min(target_cache.capacity, draft_cache.capacity)

    def run_round(self, target_cache, draft_cache, seq, warp_args, generator, depth):
        """One round after seq whose tree grows `depth` deep at most, drawing the eager walk's random numbers.
        Both caches then hold the rows the graph wrote (commit crops them). Returns (path tokens, the tree's
        size, its depth, the bonus) as host values."""
        device, B, greedy = self.target.embed.weight.device, self.block_size, warp_args[0] == 0
        idx, start = torch.tensor([seq[-1]], device=device), torch.tensor([len(seq) - 1], device=device)  # (1,) each
        draws = RewindableDraws(generator, device, greedy)
        u = draws.draw((B, 1))  # one per depth the walk may visit
        with kernels_enabled(False):
            *path, n, bonus, size, height = self.round.read_back(  # the round's one read-back
                self.budget, (B, warp_args), target_cache, draft_cache, idx, start, torch.tensor(depth, device=device),
                u, self.budget, warp_args)
        draws.spend(n + 1)  # what the eager walk spends: one number per node it visits
        target_cache.advance(self.rows())
        draft_cache.advance(self.rows())
        return path[:n], size, height, bonus


@torch.no_grad()
def fused_ddtree_generate(fused: FusedDDTree, prompt, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
                          generator=None, stop_token=EOT, on_round=None):
    """ddtree.ddtree_generate with each round one compiled graph: the same arguments (the models, block size
    and budget are fused's), tokens and counts. on_round's info has no `tree` (it never leaves the
    device) and `path` is None; a fused round has no stages to clock (draft_seconds stays None), and
    graph_seconds is the time from its graphs' calls to their read-backs, the rest of the loop's the host's."""
    target, drafter, warp_args = fused.target, fused.drafter, (temperature, top_k, top_p)
    n_new, B, target_cache, draft_cache, prefill = start_decoding(target, drafter, prompt, max_new_tokens,
                                                                  fused.block_size, warp_args)
    seq, out, tally, graph_start = list(prompt), [], Tally(B - 1, chain=False), fused.round.read_seconds
    tally.prefill = prefill
    while len(out) < n_new:
        depth = min(B - 1, n_new - len(out) - 1)  # as ddtree_generate: never past n_new
        if fused.fits(target_cache, draft_cache, seq):
            path, size, height, bonus = fused.run_round(target_cache, draft_cache, seq, warp_args, generator, depth)
            tokens, stopped = commit(seq, out, path + [bonus], stop_token, target_cache, drafter, draft_cache)
            accepted = len(path)
        else:  # at the context's end: ddtree_generate's pieces
            tree, path, bonus, hidden = grow_and_verify(
                target, drafter, target_cache, draft_cache, seq, depth, fused.budget, B, warp_args,
                lambda logits, root, n: build_tree(logits, n), lambda tree, p_at: follow_tree(tree, p_at, generator))
            tokens, stopped = commit_path(seq, out, tree, path, bonus, stop_token, target_cache, drafter, draft_cache,
                                          hidden)
            accepted, size, height = len(path), tree.size, int(tree.depths.max())
        tally.add(accepted, size, int(depth > 0), height)
        if on_round is not None:
            on_round({"tree": None, "path": None, "accepted": accepted, "tokens": tokens, "seq": list(seq),
                      "target_cache": target_cache, "draft_cache": draft_cache})
        if stopped:
            break
    graph_seconds = fused.round.read_seconds - graph_start
    return out, tally.result(out, target.embed.weight.device, graph_seconds=graph_seconds)
