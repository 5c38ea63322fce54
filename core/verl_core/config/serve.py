"""The configuration of ``verl-core serve``: Tinker's API over local models (docs/embedding.md,
"Serving the Tinker API").

One YAML file (with dotted overrides, as a run config): the address to listen on (loopback by
default), the token clients send, the base models by name (each a local Hugging Face folder), the
folder that holds saved states, and the engine that trains them (the ``actor.engine`` section of a
run, its ``model`` defaulting to the first base model's folder, whose ``path`` each base model
replaces).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import attrs

from verl_core.config.engine import EngineConfig
from verl_core.config.validators import greater_than, in_range, non_empty

#: The environment variable holding the token when the config's ``token`` is empty.
TOKEN_ENV = "VERL_CORE_SERVE_TOKEN"
#: The prefix the ``tinker`` client requires of an API key (it refuses any other before sending).
TOKEN_PREFIX = "tml-"


@attrs.define
class ServeConfig:
    """``verl-core serve``'s config."""

    #: Base model name (what clients ask for) -> its local Hugging Face folder.
    base_models: dict[str, str] = attrs.field(validator=non_empty)
    #: Where training states and sampler weights go (``tinker://<model_id>/...`` paths); a server
    #: restarted on the same folder loads what an earlier one saved.
    state_dir: str = attrs.field(validator=non_empty)
    #: The engine each training client builds (``actor.engine``'s keys); ``model.path`` is replaced
    #: by the base model's folder.
    engine: EngineConfig
    #: The token clients send as their API key (``TINKER_API_KEY``); empty: ``$VERL_CORE_SERVE_TOKEN``.
    #: The tinker client only sends keys that start with ``tml-``.
    token: str = ""
    #: The address to listen on: loopback unless you mean to serve other machines.
    host: str = "127.0.0.1"
    #: The port; 0 picks a free one (the server prints it).
    port: int = attrs.field(default=8000, validator=in_range(0, 65535))
    #: The rollout backend that samples (``hf``: core's own).
    rollout: str = "hf"
    #: Sampling sessions kept in memory (each holds a copy of the model); the least recently used
    #: beyond it are dropped and loaded again from ``state_dir`` when sampled (an RL loop makes one a step).
    samplers_in_memory: int = attrs.field(default=4, validator=in_range(1, 1_000_000))
    #: Seconds without a heartbeat (the client sends one every 10 s) after which a session whose client
    #: went away without closing is finished and its engines released.
    session_timeout_s: float = attrs.field(default=600.0, validator=greater_than(10))

    def resolved_token(self) -> str:
        """``token``, or ``$VERL_CORE_SERVE_TOKEN`` when it is empty."""
        return self.token or os.environ.get(TOKEN_ENV, "")

    def check(self) -> Iterator[tuple[str, str]]:
        token = self.resolved_token()
        if not token:
            yield (
                "token",
                f"required: set token (or the environment variable {TOKEN_ENV}); clients send it as their API key",
            )
        elif not token.startswith(TOKEN_PREFIX):
            yield "token", f"must start with {TOKEN_PREFIX!r}: the tinker client refuses any other API key"
        for name, folder in self.base_models.items():
            if not (Path(folder) / "config.json").is_file():
                yield (
                    f"base_models.{name}",
                    f"{folder!r} is not a Hugging Face model folder (no config.json): give a local folder",
                )
