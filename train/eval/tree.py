"""DDTree acceptance of one draft block (Ringel & Romano, arXiv 2604.12989; liranringel/ddtree).

Keep the top-`budget` tokens of each depth; grow a tree best-first from a heap keyed by the path's
summed log-prob, where popping node (depth d, rank r) adds it and pushes its next sibling (d, r+1)
and first child (d+1, 0), until `budget` nodes; then follow the label path from the root while the
next label is a child in the tree. Acceptance length = depth reached + 1 (the bonus token).
Because scores only fall along a path, the tree is the `budget` highest-scoring prefixes.

Legend: S depths (draft slots), R ranks kept per depth.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def tree_acceptance(
    logp_SR: Sequence[Sequence[float]],
    ids_SR: Sequence[Sequence[int]],
    labels_S: Sequence[int],
    valid_S: Sequence[bool],
    budget: int,
) -> int:
    """DDTree acceptance length (+1) of one block: S depths, each with its top-R tokens (R >= budget
    or the vocabulary) sorted by log-prob descending."""
    num_depths, num_ranks = len(logp_SR), len(logp_SR[0])
    children: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    # Heap entries: (-score, tie, depth, rank, parent node). Node 0 is the root (the anchor).
    heap = [(-logp_SR[0][0], 0, 0, 0, 0)]
    tie = 1
    while heap and len(children) < budget:
        neg, _, d, r, parent = heapq.heappop(heap)
        node = len(children) + 1
        children[(parent, ids_SR[d][r])] = node
        if r + 1 < num_ranks:  # next sibling: same parent, next-ranked token at this depth
            heapq.heappush(heap, (neg + logp_SR[d][r] - logp_SR[d][r + 1], tie, d, r + 1, parent))
            tie += 1
        if d + 1 < num_depths:  # first child: best token one depth deeper
            heapq.heappush(heap, (neg - logp_SR[d + 1][0], tie, d + 1, 0, node))
            tie += 1
    node, depth = 0, 0
    while depth < num_depths and valid_S[depth] and (node, labels_S[depth]) in children:
        node = children[(node, labels_S[depth])]
        depth += 1
    return depth + 1
