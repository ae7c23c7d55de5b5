"""Radix tree of token sequences -> exact state snapshots, under a byte budget with LRU eviction.

A snapshot is only ever used at exactly the length it was taken: a request reuses the longest snapshot whose
whole key is a prefix of its tokens, never part of one (recurrent state cannot be rewound).

Each cache salt (vLLM's `cache_salt`: a tenant, a user, an API key) has a tree of its own, so a request can only
reuse, or learn through `cached_tokens` of the existence of, prefixes cached under the same salt. One byte budget
and one LRU order cover all trees.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from .state import Snapshot


@dataclass
class Node:
    edge: tuple[int, ...]                       # tokens on the edge from the parent to this node
    parent: "Node | None"
    children: dict[int, "Node"] = field(default_factory=dict)
    snapshot: Snapshot | None = None
    last_use: int = 0


class PrefixCache:
    def __init__(self, budget_bytes: int, on_drop: Callable[[Snapshot], None] = lambda snap: None):
        """on_drop: told of every snapshot the cache lets go (evicted, replaced or cleared)."""
        self.budget = budget_bytes
        self.on_drop = on_drop
        self.roots: dict[str | None, Node] = {}
        self.bytes = 0
        self.entries = 0
        self._clock = itertools.count(1)

    def match(self, tokens: list[int], max_len: int | None = None, salt: str | None = None) -> Snapshot | None:
        """The longest snapshot stored under `salt` whose key is a prefix of tokens[:max_len]; marks it recently
        used."""
        tokens = tokens[:max_len] if max_len is not None else tokens
        node, depth, best = self.roots.get(salt), 0, None
        if node is None:
            return None
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None or tuple(tokens[depth:depth + len(child.edge)]) != child.edge:
                break
            node, depth = child, depth + len(child.edge)
            if node.snapshot is not None:
                best = node
        if best is None:
            return None
        best.last_use = next(self._clock)
        return best.snapshot

    def insert(self, tokens: list[int], snapshot: Snapshot, salt: str | None = None) -> None:
        """Store `snapshot` under `salt` as the state after exactly `tokens`; evicts least recently used entries to
        fit."""
        assert snapshot.length == len(tokens), "a snapshot is keyed by exactly the tokens it has seen"
        if snapshot.nbytes > self.budget:
            self.on_drop(snapshot)
            return
        node, depth = self.roots.setdefault(salt, Node((), None)), 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = Node(tuple(tokens[depth:]), node)
                node.children[tokens[depth]] = leaf
                node, depth = leaf, len(tokens)
                break
            common = _common_prefix(child.edge, tokens[depth:])
            if common < len(child.edge):                       # split the edge at the divergence point
                mid = Node(child.edge[:common], node)
                node.children[tokens[depth]] = mid
                child.edge, child.parent = child.edge[common:], mid
                mid.children[child.edge[0]] = child
                child = mid
            node, depth = child, depth + common
        if node.snapshot is not None:
            self.bytes -= node.snapshot.nbytes
            self.entries -= 1
            self.on_drop(node.snapshot)
        node.snapshot, node.last_use = snapshot, next(self._clock)
        self.bytes += snapshot.nbytes
        self.entries += 1
        self._evict(keep=node)

    def _evict(self, keep: Node) -> None:
        while self.bytes > self.budget:
            victims = [n for n in self._nodes() if n.snapshot is not None and n is not keep]
            if not victims:
                return
            self._remove(min(victims, key=lambda n: n.last_use))

    def _remove(self, node: Node) -> None:
        self.bytes -= node.snapshot.nbytes
        self.entries -= 1
        self.on_drop(node.snapshot)
        node.snapshot = None
        # prune empty leaves and merge pass-through nodes so the tree stays small
        while node.parent is not None and node.snapshot is None and len(node.children) <= 1:
            parent = node.parent
            if node.children:
                (child,) = node.children.values()
                child.edge, child.parent = node.edge + child.edge, parent
                parent.children[node.edge[0]] = child
            else:
                del parent.children[node.edge[0]]
            node = parent
        if node.parent is None and not node.children:          # an emptied tree: forget its salt
            self.roots = {salt: root for salt, root in self.roots.items() if root is not node}

    def _nodes(self) -> Any:
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def clear(self) -> None:
        for node in self._nodes():
            if node.snapshot is not None:
                self.on_drop(node.snapshot)
        self.roots, self.bytes, self.entries = {}, 0, 0


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
