"""Seeds derived from a run's seed, stable across runs, platforms and Python versions.

``derive_seed(namespace, *parts)`` gives the seed of one use of randomness (a step's generation round,
a validation batch, a data-parallel rank's share) from the parts that identify it, and
``seeded_random`` the ``random.Random`` the epoch order of the prompts comes from. Both hash the parts
as a string with SHA-512 (``random.Random`` of a string): unlike ``hash()`` stable everywhere, and
unlike arithmetic on integers free of collisions between, say, ``(1, 0)`` and ``(0, 1000003)``.
Nothing here imports torch.
"""

from __future__ import annotations

import random

#: Seeds fit a signed 32-bit int, which every generator takes.
SEED_BITS = 31


def seeded_random(namespace: str, *parts: object) -> random.Random:
    """A ``random.Random`` seeded by ``namespace`` and ``parts`` (their ``str``)."""
    return random.Random(":".join([namespace, *map(str, parts)]))


def derive_seed(namespace: str, *parts: object) -> int:
    """A seed in ``[0, 2**31)`` for the use of randomness ``namespace`` names, identified by ``parts``."""
    return seeded_random(namespace, *parts).getrandbits(SEED_BITS)
