"""Split backward: B (the input gradient) now, W (the weight gradient) later.

The zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) run a
stage's backward in two actions: B computes the gradient of the stage's input, which the
previous stage waits for, and W the gradients of its parameters, which nobody waits for, so
it can fill what would be bubble. For ``y = x A^T + b``: B is ``dx = dy A``, W is
``dA = dy^T x`` and ``db = sum(dy)``; both need ``dy``, W also needs ``x``.

On the autograd graph of one stage and one microbatch (from its outputs back to its inputs
and parameters), call a node *input side* when the stage input's gradient node can be reached
from it; the other nodes are on the *weight side*, on the way to parameters only. A *boundary*
node is an input-side node with an edge into the weight side (the ``AddmmBackward`` of the
example: one edge towards x, two towards A and b).

- `backward_input` (B): ``torch.autograd.grad(outputs, inputs, grad_outputs,
  retain_graph=True)``. Autograd runs only what leads to the inputs, and inside a boundary
  node computes only the outputs it needs (``dx``, not ``dA``). A pre-hook on every boundary
  node keeps the gradient arriving there (``dy``).
- `SplitBackward.backward_weight` (W): for each group of boundary nodes, a backward from the
  nodes with their kept gradients into the group's parameters only
  (``torch.autograd.backward(edges, grads, inputs=params)``), so autograd re-enters each
  boundary node for its weight-side outputs and does not go down the input side again. The
  gradients accumulate into ``.grad`` through the parameters' AccumulateGrad nodes, as a
  plain backward's do (gradient hooks fire). Boundary nodes whose weight sides reach a common
  parameter (a weight used twice in the stage) form one group; in it each node's incoming
  gradient is pinned to its kept value with a pre-hook, so the input side between them
  (which the group's backward does run again then) adds nothing twice.
- Stage 0 (no input needs a gradient) has no input side: B computes nothing and W is the
  stage's whole backward. Outputs whose own node is on the weight side are treated as
  boundary nodes with the given output gradient.

Memory: the graph's saved tensors live from F to W (``retain_graph`` in B); W drops them. The
extra state between B and W is one kept gradient per boundary node (the size of that layer's
output). The schedules count a split microbatch as alive until its W (`simulate`).

torch.distributed.pipelining does the same in ``stage_backward_input`` /
``stage_backward_weight``; this is written from the description above.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


class SplitBackward:
    """What B leaves for W: the boundary nodes, their kept gradients and their parameters."""

    def __init__(self, groups: list[tuple[list[tuple[Node, tuple, bool]], list[torch.Tensor]]]):
        self._groups = groups  # [([(boundary node, kept grad_outputs, pin it)], [parameters])]

    def backward_weight(self) -> None:
        """W: accumulate the parameters' gradients into ``.grad``; frees the graph."""
        groups, self._groups = self._groups, []
        for members, params in groups:
            edges, grads, pins = [], [], []
            for node, kept, pin in members:
                for i, g in enumerate(kept):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
                if pin and len(members) > 1:
                    pins.append(node.register_prehook(lambda _, kept=kept: kept))
            try:
                if edges:
                    torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)
            finally:
                for handle in pins:
                    handle.remove()


def backward_input(outputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor],
                   inputs: Sequence[torch.Tensor],
                   params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor | None],
                                                            SplitBackward]:
    """B: the gradients of ``inputs`` (None where unused) and what W needs later.

    Args:
        outputs: the stage's outputs that carry gradients (the last stage: the loss).
        grad_outputs: their gradients (same shapes).
        inputs: the stage's inputs that need gradients (leaves with ``requires_grad``).
        params: the stage's parameters with ``requires_grad``.
    """
    input_nodes = {n for n in (_grad_node(x) for x in inputs) if n is not None}
    roots = [_grad_node(o) for o in outputs]
    children = _graph(r for r in roots if r is not None)
    input_side = _reaching(children, input_nodes)
    param_of = {_grad_node(p): p for p in params}
    below = _params_below(children, input_side, param_of)

    boundary: dict[Node, frozenset] = {}  # boundary node -> ids of the parameters W reaches
    for node, kids in children.items():
        if node in input_side:
            reach = frozenset().union(*(below[c] for c in kids if c not in input_side))
            if reach:
                boundary[node] = reach
    kept: dict[Node, tuple] = {}
    hooks = [node.register_prehook(lambda grads, node=node: kept.__setitem__(node, grads))
             for node in boundary]
    try:
        if input_nodes:
            grads = torch.autograd.grad(list(outputs), list(inputs), list(grad_outputs),
                                        retain_graph=True, allow_unused=True)
        else:
            grads = [None] * len(inputs)
    finally:
        for handle in hooks:
            handle.remove()
    members = [(node, kept[node], True, reach) for node, reach in boundary.items()
               if node in kept]  # (a node B's gradient never reached contributes nothing)
    given: dict[Node, list] = {}  # weight-side outputs: their gradients are the given ones
    for o, g, root in zip(outputs, grad_outputs, roots, strict=True):
        if root is not None and root not in input_side and below.get(root):
            slots = given.setdefault(root, [])
            slots += [None] * (o.output_nr + 1 - len(slots))
            slots[o.output_nr] = g
    members += [(root, tuple(slots), False, below[root]) for root, slots in given.items()]
    return list(grads), SplitBackward(_group(members, param_of))


# -------------------------------------------------------------------------------------------
# helpers


def _grad_node(t: torch.Tensor) -> Node | None:
    """The node a gradient for ``t`` enters: its grad_fn, or a leaf's AccumulateGrad."""
    if t.grad_fn is not None:
        return t.grad_fn
    if t.requires_grad:  # a leaf: view_as's backward points at its AccumulateGrad
        return t.view_as(t).grad_fn.next_functions[0][0]
    return None


def _graph(roots) -> dict[Node, list[Node]]:
    """Node -> the nodes it sends gradients to, for everything reachable from ``roots``."""
    children: dict[Node, list[Node]] = {}
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in children:
            continue
        children[node] = [c for c, _ in node.next_functions if c is not None]
        stack.extend(c for c in children[node] if c not in children)
    return children


def _reaching(children: dict[Node, list[Node]], targets: set[Node]) -> set[Node]:
    """The nodes from which some node of ``targets`` can be reached (targets included)."""
    parents: dict[Node, list[Node]] = {}
    for node, kids in children.items():
        for c in kids:
            parents.setdefault(c, []).append(node)
    found, stack = set(), [t for t in targets if t in children]
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        stack.extend(parents.get(node, []))
    return found


def _params_below(children, input_side, param_of) -> dict[Node, frozenset]:
    """Weight-side node -> the ids of the parameters reachable from it (memoised, iterative)."""
    below: dict[Node, frozenset] = {}
    for start in children:
        if start in input_side or start in below:
            continue
        stack = [(start, False)]
        while stack:
            node, expanded = stack.pop()
            if node in below:
                continue
            kids = [c for c in children[node] if c not in input_side]
            if not expanded:
                stack.append((node, True))
                stack.extend((c, False) for c in kids if c not in below)
                continue
            own = frozenset([id(param_of[node])]) if node in param_of else frozenset()
            below[node] = own.union(*(below[c] for c in kids))
    return below


def _group(members, param_of):
    """Union the boundary nodes that reach a common parameter; each group with its parameters."""
    by_id = {id(p): p for p in param_of.values()}
    groups: list[tuple[list, set]] = []
    for node, kept, pin, reach in members:
        nodes, ids = [(node, kept, pin)], set(reach)
        for g in [g for g in groups if g[1] & ids]:
            nodes += g[0]
            ids |= g[1]
            groups.remove(g)
        groups.append((nodes, ids))
    return [(nodes, [by_id[i] for i in sorted(ids)]) for nodes, ids in groups]
