"""Prove the rollout decoder's GPU path on a CUDA machine: ``python benchmarks/decoder_gpu_check.py``.

Runs the tests of ``tests/test_rollout_decoder.py`` marked ``gpu`` (skipped on CPU-only machines):
``LeanDecoder`` on CUDA, plain products in float32, bfloat16 and float16, fused and separate, against
the model's own forward on the same GPU (logits at the prefill and six steps, rows dropped and
repeated, a weight update between), the broken variant the comparison must catch, and the rollout's
sampled tokens and log-probs against the model's own forward. Exits non-zero when CUDA is missing
(nothing would be proved) or when any check fails. Needs the editable install of verl-core
(``pip install -e .[test]``). Takes well under a minute.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parents[1] / "tests" / "test_rollout_decoder.py"


def main() -> int:
    if not torch.cuda.is_available():
        print("decoder_gpu_check: CUDA is not available here; run this on a GPU machine", file=sys.stderr)
        return 2
    print(
        f"decoder_gpu_check: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}"
    )
    # -p no:cacheprovider: the check leaves nothing behind in the checkout.
    return int(pytest.main([str(TESTS), "-m", "gpu", "-v", "-rs", "-p", "no:cacheprovider"]))


if __name__ == "__main__":
    sys.exit(main())
