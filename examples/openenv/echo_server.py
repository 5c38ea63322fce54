"""A small OpenEnv environment served by openenv's own server code, for the ``openenv`` environment
(docs/agents.md, 'Environments served by OpenEnv'): ``python echo_server.py PORT`` serves it on
127.0.0.1:PORT.

Each session echoes the model's message back (``EchoObservation.echoed``) and rewards its length (the
characters of the message, over 10, at most 1); the episode is done after ``TURNS`` messages. Every
conversation of a training step holds a session at once: the server allows 1024."""

import sys

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, State, create_app

#: Messages per episode.
TURNS = 2


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed: str = ""


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> EchoObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(echoed="")

    def step(self, action: EchoAction, timeout_s=None, **kwargs) -> EchoObservation:
        self._state.step_count += 1
        return EchoObservation(
            echoed=action.message,
            reward=min(len(action.message) / 10, 1.0),
            done=self._state.step_count >= TURNS,
        )

    @property
    def state(self) -> State:
        return self._state


app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo", max_concurrent_envs=1024)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
