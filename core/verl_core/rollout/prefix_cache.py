"""The built-in rollout's prefix cache: the KV caches of recently finished requests, kept so that a
request whose prompt begins as one of their sequences does (a conversation's next turn: the previous
prompt, the reply, the environment's message) prefills only the tokens after it.

Entries are found by their tokens, as vLLM's prefix cache finds its blocks (a request names no
conversation): the entry sharing the longest prefix with the prompt serves that prefix, up to the
prompt's last token at most (that token always runs: the request samples from its logits). An entry
holds the keys and values of the tokens the model ran for a request: its prompt and every token it
generated but the last (sampled, never fed back), so a next turn prefills that reply's last token
and the environment's message. At most ``size`` entries, the least recently used dropped first; an
entry whose tokens a newer one continues is replaced by it. The cache is stamped with the weights its
entries were computed under and serves only those: ``HFRollout`` clears it when its weights change
(``update_weights``) and on ``sleep()``, and the stamp covers any other write to the weights.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verl_core.rollout.decoder import KVPrefix

#: Tokens compared at a time by ``common_prefix`` (in C), before the first block that differs is
#: walked token by token.
BLOCK = 64


class PrefixCache:
    """At most ``size`` sequences' keys and values (``KVPrefix``), least recently used dropped first;
    ``size`` 0 keeps none. Safe to call from several threads (a weight update may clear it while a
    request is served)."""

    def __init__(self, size: int):
        self.size = size
        #: The keys and values of each sequence, by its tokens.
        self._entries: OrderedDict[tuple[int, ...], KVPrefix] = OrderedDict()
        #: The weights every entry was computed under.
        self._weights: Hashable = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """The positions held, over every entry."""
        return sum(len(tokens) for tokens in list(self._entries))

    def longest(self, prompt: Sequence[int], weights: Hashable) -> KVPrefix | None:
        """The longest cached prefix of ``prompt`` computed under ``weights``, short of its last token
        (``None``: no entry shares its first token). Entries of other weights are dropped."""
        prompt = tuple(prompt)
        with self._lock:
            self._stamp(weights)
            best, length = None, 0
            for tokens in self._entries:
                shared = min(common_prefix(tokens, prompt), len(prompt) - 1)
                if shared > length:
                    best, length = tokens, shared
            if best is None:
                return None
            self._entries.move_to_end(best)
            return self._entries[best].first(length)

    def add(self, tokens: Sequence[int], prefix: KVPrefix, weights: Hashable) -> None:
        """Keep ``prefix``, the keys and values of ``tokens`` under ``weights``, as the most recently used
        entry; an entry it continues is dropped, and it is not kept where an entry continues it."""
        tokens = tuple(tokens)
        if self.size == 0 or not tokens:
            return
        if prefix.length != len(tokens):
            raise ValueError(f"a prefix of {prefix.length} positions for {len(tokens)} tokens")
        with self._lock:
            self._stamp(weights)
            for cached in list(self._entries):
                shared = common_prefix(cached, tokens)
                if shared == len(tokens):  # an entry holds these tokens and more
                    self._entries.move_to_end(cached)
                    return
                if shared == len(cached):
                    del self._entries[cached]
            self._entries[tokens] = prefix
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def _stamp(self, weights: Hashable) -> None:
        """Drop every entry unless it was computed under ``weights``."""
        if weights != self._weights:
            self._entries.clear()
            self._weights = weights


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The number of leading tokens ``a`` and ``b`` share: compared ``BLOCK`` tokens at a time, then
    token by token within the first block that differs."""
    shortest = min(len(a), len(b))
    start = 0
    while start < shortest and a[start : start + BLOCK] == b[start : start + BLOCK]:
        start += BLOCK
    end = min(start + BLOCK, shortest)
    while start < end and a[start] == b[start]:
        start += 1
    return min(start, shortest)
