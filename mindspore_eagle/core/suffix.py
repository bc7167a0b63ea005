"""Suffix candidates: draft tokens copied from earlier text, at no model cost.

Pure Python / numpy; never imports MindSpore (docs/architecture.md, "core/ (numpy only)").

A small teacher repeats itself: names, identifiers, the question's own words, list items, a second turn that
reuses the first. SuffixDecoding (Oliaro et al., NeurIPS 2025, §3) drafts such tokens from suffix trees over the
prompt, the output so far and earlier outputs, scoring each continuation by how often it followed the match. Here
(docs/design.md, "Suffix candidates"):

- :class:`SuffixIndex` keeps, for every k in 1 .. ``max_match``, the places where each k-token run ends, over a set
  of documents (token lists). Appending a token costs ``max_match`` dict inserts (incremental per token); a query
  looks up the context's last k tokens for k = ``max_match`` down to ``min_match`` and stops at the longest run
  that occurred before with at least one token after it. Documents can be dropped (oldest first when the index
  holds more than ``max_tokens``), so a process-wide index of earlier outputs stays bounded.
- :func:`propose` merges the continuations of the longest match found in one or more indexes (a sequence's own
  prompt + output, and the process's earlier outputs) into a trie of depth <= D: node probability = the share of
  the match's occurrences whose continuation starts with the node's path (the frequency score of SuffixDecoding),
  cumulative by construction, so a child never scores above its parent.

The result is a :class:`~mindspore_eagle.core.tree.DraftTree` whose ``scores`` are log-probabilities like the
drafter's; :func:`~mindspore_eagle.core.tree.merge_trees` joins it with the drafter's tree, and the acceptance model
(core/calibration.py) calibrates each source separately, so an over-confident frequency score is corrected by what
verification accepts.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from mindspore_eagle.core.tree import SOURCE_SUFFIX, DraftTree

MAX_MATCH = 8        # longest run looked up (tokens); SuffixDecoding matches up to 64 over a suffix tree
MIN_MATCH = 2        # shortest run that counts as a match: a single token repeats too often to predict anything
MAX_OCCURRENCES = 32  # most recent occurrences of the matched run whose continuations build the trie


class SuffixIndex:
    """Where every run of 1 .. ``max_match`` tokens ends, over a bounded set of token documents.

    Args:
        max_match: longest run indexed and looked up (int >= 1). min_match: shortest run a query accepts
            (1 <= min_match <= max_match). max_tokens: when > 0, the oldest documents are dropped once the index
            holds more tokens (the document being extended is never dropped).
    Raises:
        ValueError: a size outside its range.
    """

    def __init__(self, max_match: int = MAX_MATCH, min_match: int = MIN_MATCH, max_tokens: int = 0):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"suffix index: need 1 <= min_match ({min_match}) <= max_match ({max_match})")
        if max_tokens < 0:
            raise ValueError(f"suffix index: max_tokens = {max_tokens} must be >= 0 (0 = unbounded)")
        self.max_match, self.min_match, self.max_tokens = int(max_match), int(min_match), int(max_tokens)
        self._ends: list[dict] = [{} for _ in range(self.max_match)]   # k - 1 -> {run tuple: [(doc, end), ...]}
        self.docs: OrderedDict[int, list] = OrderedDict()             # doc id -> tokens, oldest first
        self.keys: dict[int, object] = {}                               # doc id -> key (queries can exclude it)
        self.tokens = 0
        self._next_id = 0

    def __len__(self) -> int:
        """Documents held."""
        return len(self.docs)

    def add(self, tokens=(), key=None) -> int:
        """A new document holding ``tokens`` (int sequence); ``key`` (any hashable) lets a query skip it.
        Returns the document id."""
        doc = self._next_id
        self._next_id += 1
        self.docs[doc] = []
        self.keys[doc] = key
        self.extend(doc, tokens)
        return doc

    def extend(self, doc: int, tokens) -> None:
        """Append ``tokens`` to document ``doc`` and index every run that ends in them.

        Raises:
            KeyError: ``doc`` is not held (never added, or dropped).
        """
        text = self.docs[doc]
        for t in tokens:
            text.append(int(t))
            end = len(text)
            for k in range(1, min(self.max_match, end) + 1):
                self._ends[k - 1].setdefault(tuple(text[end - k:end]), []).append((doc, end))
        self.tokens += len(tokens)
        while self.max_tokens and self.tokens > self.max_tokens and len(self.docs) > 1:
            oldest = next(iter(self.docs))
            if oldest == doc:
                break
            self.drop(oldest)

    def drop(self, doc: int) -> None:
        """Forget document ``doc`` (its runs leave the index). Raises KeyError when it is not held."""
        text = self.docs.pop(doc)
        self.keys.pop(doc)
        self.tokens -= len(text)
        for end in range(1, len(text) + 1):
            for k in range(1, min(self.max_match, end) + 1):
                run = tuple(text[end - k:end])
                ends = self._ends[k - 1][run]
                ends.remove((doc, end))      # a doc's entries are the oldest of the list when it is the oldest doc
                if not ends:
                    del self._ends[k - 1][run]

    def match(self, context, exclude_key=None, limit: int = MAX_OCCURRENCES) -> tuple[int, list]:
        """The longest run of ``context``'s last tokens (``min_match`` .. ``max_match`` long) that ended somewhere
        with at least one token after it, in a document whose key is not ``exclude_key``.

        Args:
            context: int sequence, the text so far (its last token is the draft root).
            limit: keep at most this many occurrences, the most recent first.
        Returns:
            (k, [(doc, end), ...]): the run's length and its occurrences, newest first (``end`` = index of the
            first token after the run); (0, []) when no run of ``min_match`` tokens occurred before.
        """
        ctx = [int(t) for t in context[-self.max_match:]]
        for k in range(min(self.max_match, len(ctx)), self.min_match - 1, -1):
            found = []
            for doc, end in reversed(self._ends[k - 1].get(tuple(ctx[len(ctx) - k:]), ())):
                if end < len(self.docs[doc]) and (exclude_key is None or self.keys[doc] != exclude_key):
                    found.append((doc, end))
                    if len(found) >= limit:
                        break
            if found:
                return k, found
        return 0, []

    def continuations(self, occurrences, depth: int) -> list[list[int]]:
        """The next ``depth`` tokens (fewer at a document's end) after each occurrence of :meth:`match`."""
        return [self.docs[doc][end:end + depth] for doc, end in occurrences]


@dataclass
class SuffixProposal:
    """What :func:`propose` found: ``tree`` (DraftTree, ``source`` all SOURCE_SUFFIX; None when nothing matched),
    the matched run's length ``match_len`` (tokens) and the number of occurrences the trie was built from."""
    tree: DraftTree | None
    match_len: int
    occurrences: int


def propose(root: int, sources, depth: int, max_nodes: int, limit: int = MAX_OCCURRENCES) -> SuffixProposal:
    """A draft tree of the continuations that followed the longest earlier match of the context.

    Args:
        root: the draft root (the pending token, the context's last token).
        sources: sequence of (SuffixIndex, context int sequence, exclude_key) searched together; the longest match
            over all of them wins, and the occurrences of every source with that length are pooled.
        depth: D, maximum draft depth (root 0). max_nodes: keep the root plus the best ``max_nodes - 1`` nodes.
        limit: occurrences taken per source (newest first).
    Returns:
        SuffixProposal; its tree has parents before children (breadth first, likelier siblings first) and
        ``scores`` float32 [n] = log(share of occurrences through the node), root 0.
    Raises:
        ValueError: depth < 1 or max_nodes < 1.
    """
    if depth < 1 or max_nodes < 1:
        raise ValueError(f"suffix propose: depth = {depth} and max_nodes = {max_nodes} must be >= 1")
    found = [(idx, idx.match(ctx, key, limit)) for idx, ctx, key in sources]
    best = max((k for _, (k, _) in found), default=0)
    if best == 0 or max_nodes < 2:
        return SuffixProposal(None, best, 0)
    conts = [c for idx, (k, occ) in found if k == best for c in idx.continuations(occ, depth) if c]
    counts: dict[tuple, int] = {}
    for c in conts:
        for j in range(1, len(c) + 1):
            counts[tuple(c[:j])] = counts.get(tuple(c[:j]), 0) + 1
    # breadth first; among nodes of one depth the likelier (then the earlier seen) first: parents precede children
    paths = sorted(counts, key=lambda p: (len(p), -counts[p]))
    keep = sorted(paths, key=lambda p: -counts[p])[: max_nodes - 1]    # stable: a parent outranks its child
    keep_set = set(keep)
    paths = [p for p in paths if p in keep_set]
    index = {(): 0}
    tokens, parents, scores = [int(root)], [0], [0.0]
    for p in paths:
        index[p] = len(tokens)
        tokens.append(p[-1])
        parents.append(index[p[:-1]])
        scores.append(np.log(counts[p] / len(conts)))
    src = np.full(len(tokens), SOURCE_SUFFIX, np.int8)
    return SuffixProposal(DraftTree(np.asarray(tokens), np.asarray(parents), np.asarray(scores, np.float32), src),
                          best, len(conts))


__all__ = ["MAX_MATCH", "MAX_OCCURRENCES", "MIN_MATCH", "SuffixIndex", "SuffixProposal", "propose"]
