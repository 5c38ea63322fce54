"""Write a verifiers environment's dataset as the trainer's data files: ``python
examples/verifiers/export_dataset.py ENV_ID OUT_DIR [--env-args JSON]`` writes ``OUT_DIR/train.jsonl``
(``get_dataset()``) and ``OUT_DIR/val.jsonl`` (``get_eval_dataset()``, verifiers' training set when the
environment has none), one row per example with the columns verifiers' rollouts take: ``prompt`` (chat
messages), ``answer``, ``example_id`` and whatever else the environment's dataset holds (``info``, ``task``).
The ``verifiers`` environment (docs/agents.md) starts each conversation from its row."""

import argparse
import json
from pathlib import Path

import verifiers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("env_id", help="the environment's module, as verifiers.load_environment takes it")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--env-args", default="{}", help="load_environment's keyword arguments, as JSON")
    args = parser.parse_args()
    environment = verifiers.load_environment(args.env_id, **json.loads(args.env_args))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # get_eval_dataset() is the training set when the environment has no eval dataset.
    for name, dataset in (("train", environment.get_dataset()), ("val", environment.get_eval_dataset())):
        dataset.to_json(args.out_dir / f"{name}.jsonl")
        print(f"{args.out_dir / name}.jsonl: {len(dataset)} rows")


if __name__ == "__main__":
    main()
