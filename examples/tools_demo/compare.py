"""The tools demo's figures: a model's validation score with the tool and without it (the same
prompts and sampling as examples/tools_demo/grpo.yaml; without the tool, a call gets no answer).

    python examples/tools_demo/compare.py runs/tools_demo/grpo/hf_model
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from verl_core.config import load_config
from verl_core.trainer.rl import RLTrainer

CONFIG = Path(__file__).parent / "grpo.yaml"


def validation_score(model: str, with_tools: bool, run_dir: str) -> float:
    overrides = [f"actor.engine.model.path={model}", "trainer.logger=[]", f"trainer.run_dir={run_dir}"]
    if not with_tools:
        overrides += ["rollout.agent.environment=null", "rollout.agent.tools=null"]
    trainer = RLTrainer.from_config(load_config([CONFIG], overrides), show_progress=False)
    try:
        return trainer.validate(0)["val/score/mean"]
    finally:
        trainer.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Validation score of a model with and without the tool.")
    parser.add_argument("model", help="a Hugging Face folder (the SFT or GRPO export)")
    parser.add_argument("--run-dir", default="runs/tools_demo/compare", help="where validation samples go")
    parser.add_argument("--out", type=Path, help="also write the scores there, as JSON")
    args = parser.parse_args(argv)
    scores = {
        name: validation_score(args.model, with_tools, f"{args.run_dir}/{name}")
        for name, with_tools in (("with_tools", True), ("without_tools", False))
    }
    line = json.dumps({"model": args.model, **scores})
    print(line)
    if args.out is not None:
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
