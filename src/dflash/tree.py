"""Candidate trees: several continuations of each row checked by the target in one forward.

One DFlash forward gives a distribution at every block slot, but a chain verifies only the argmax path through
them: a wrong argmax at slot k loses the rest of the block even where the right token was the draft's second
choice. A tree holds the most probable paths (path probability = the product of the slot probabilities along
it; every prefix of a path is at least as probable as the path, so the N most probable paths form a tree),
and, as extra branches, the n-gram continuations of the text (small models copy much from the prompt and from
themselves), merged where they share a prefix. The target verifies all nodes in one forward, each node seeing
the committed context and its own ancestors; the longest path whose every token is the target's own choice
after its parent is kept, plus the target's token after it. Greedy output stays plain decoding's exactly: a
node is accepted only where its token is the target's argmax.

Nodes are numbered parents first (node 0 is the anchor, the row's last committed token), so an accepted path
lies in increasing slots and positions.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

DRAFT, NGRAM = 1, 2  # where a node's path came from (bits of `source`)


@dataclass
class Trees:
    """The candidate trees of L rows, padded to N nodes each (pad nodes are never accepted)."""

    tokens: torch.Tensor  # [L, N] node tokens; node 0 is the anchor
    parent: torch.Tensor  # [L, N] parent node (the root's own index, 0)
    depth: torch.Tensor  # [L, N] 0 for the root
    visible: torch.Tensor  # [L, N, N] bool: node i sees node j (j is i or an ancestor of i)
    alive: torch.Tensor  # [L, N] bool: a real node, not padding
    source: list[list[int]]  # per row and node: DRAFT | NGRAM bits
    rank: list[list[int]]  # per row and node: the order in which the draft's paths were taken (-1: n-gram only)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


class _Tree:
    def __init__(self, anchor: int):
        self.tokens, self.parent, self.depth = [anchor], [0], [0]
        self.source, self.rank = [0], [0]
        self.children: dict[tuple[int, int], int] = {}

    def add(self, parent: int, token: int, source: int, rank: int = -1) -> int:
        node = self.children.get((parent, token))
        if node is not None:
            self.source[node] |= source
            if rank >= 0 and self.rank[node] < 0:
                self.rank[node] = rank
            return node
        node = len(self.tokens)
        self.tokens.append(token)
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.source.append(source)
        self.rank.append(rank)
        self.children[(parent, token)] = node
        return node


def build_trees(anchors: list[int], top_ids: list[list[list[int]]], top_logp: list[list[list[float]]],
                budget: int, continuations: list[list[int]] | None, device, min_nodes: int = 1) -> Trees:
    """The trees of L rows. anchors: each row's last committed token; top_ids / top_logp: [L][B-1][k] the draft's k
    most probable tokens at every block slot and their log-probabilities; budget: draft nodes per row (the most
    probable paths, best first); continuations: per row the n-gram continuation of its text (extra nodes where
    it leaves the draft's paths), or None; min_nodes: pad every tree to at least this many nodes."""
    trees = []
    for r, anchor in enumerate(anchors):
        tree = _Tree(anchor)
        slots = len(top_ids[r])
        # best first by path log-probability: (-logp, order, parent node, depth of the child, token index)
        heap, order = [], 0
        for i, (t, lp) in enumerate(zip(top_ids[r][0], top_logp[r][0])):
            heapq.heappush(heap, (-lp, order, 0, 1, t))
            order += 1
        taken = 0
        while heap and taken < budget:
            neg, _, parent, depth, token = heapq.heappop(heap)
            node = tree.add(parent, token, DRAFT, taken)
            taken += 1
            if depth < slots:
                for t, lp in zip(top_ids[r][depth], top_logp[r][depth]):
                    heapq.heappush(heap, (neg - lp, order, node, depth + 1, t))
                    order += 1
        if continuations is not None:
            node = 0
            for t in continuations[r][:slots]:
                node = tree.add(node, t, NGRAM)
        trees.append(tree)
    N = max(min_nodes, max(len(t.tokens) for t in trees))
    L = len(trees)
    tokens = torch.zeros(L, N, dtype=torch.long)
    parent = torch.zeros(L, N, dtype=torch.long)
    depth = torch.zeros(L, N, dtype=torch.long)
    alive = torch.zeros(L, N, dtype=torch.bool)
    visible = torch.zeros(L, N, N, dtype=torch.bool)
    visible[:, torch.arange(N), torch.arange(N)] = True  # a pad node sees itself (and so has finite states)
    for r, t in enumerate(trees):
        n = len(t.tokens)
        tokens[r, :n] = torch.tensor(t.tokens)
        tokens[r, n:] = t.tokens[0]
        parent[r, :n] = torch.tensor(t.parent)
        depth[r, :n] = torch.tensor(t.depth)
        alive[r, :n] = True
        for i in range(1, n):  # ancestors come first: a node sees what its parent sees, and itself
            visible[r, i, :i] = visible[r, t.parent[i], :i]
        depth[r, n:] = 1
    return Trees(tokens.to(device), parent.to(device), depth.to(device), visible.to(device), alive.to(device),
                 [t.source for t in trees], [t.rank for t in trees])


def accepted_nodes(tokens: torch.Tensor, parent: torch.Tensor, alive: torch.Tensor | None, choice: torch.Tensor,
                   max_depth: int) -> torch.Tensor:
    """[L, N] whether each node is accepted: it and every ancestor below the root is the target's choice after
    its parent (choice [L, N]: the target's token after every node; alive: real nodes, None: all)."""
    ok = tokens == choice.gather(1, parent)
    if alive is not None:
        ok &= alive
    ok[:, 0] = True
    for _ in range(max_depth):  # a node is accepted when its whole ancestry is
        ok = ok & ok.gather(1, parent)
    return ok


def accept(trees: Trees, choice: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The longest path of each row whose every node is the target's choice after its parent.
    choice: [L, N] the target's own token after every node. Returns (path [L, max_depth + 1] node indices from the
    root, padded by repeating the last; accepted [L] its number of accepted draft nodes)."""
    ok = accepted_nodes(trees.tokens, trees.parent, trees.alive, choice, max_depth)
    deepest = torch.where(ok, trees.depth, -1).argmax(1)  # siblings hold distinct tokens: one path per depth
    accepted = trees.depth.gather(1, deepest[:, None])[:, 0]
    # walk up from the deepest node; row r's path is path[r, :accepted[r] + 1]
    steps = [deepest]
    for _ in range(max_depth):
        steps.append(trees.parent.gather(1, steps[-1][:, None])[:, 0])
    up = torch.stack(steps, 1)  # [L, D+1]: deepest first, then its ancestors, then the root repeated
    j = torch.arange(max_depth + 1, device=choice.device)
    index = (accepted[:, None] - j).clamp(min=0)  # root first: up[accepted - j]
    path = up.gather(1, index)
    return path, accepted
