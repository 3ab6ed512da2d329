"""Datasets, data loading and task builders.

- `build_task` / `TASKS`: generate arithmetic, GSM8K-style and countdown
  problems as verl-format parquet (`tasks.py` and one module per task).
- `RLDataset`: reads any verl-format parquet, applies the chat template and
  left-pads prompts (`dataset.py`); `collate` makes a DataProto of its items.
- `StatefulDataLoader`: seeded, resumable batches of prompts (`loader.py`).
- SFT: `build_sft_task` (prompt/response/messages sets of tasks with a known answer),
  `SFTDataset` and `sft_collate` (`sft.py`).
"""

import hybridflow.data.arithmetic  # noqa: F401  (the built-in tasks register themselves)
import hybridflow.data.countdown  # noqa: F401
import hybridflow.data.gsm8k  # noqa: F401
import hybridflow.data.tool_arithmetic  # noqa: F401
from hybridflow.data.loader import StatefulDataLoader
from hybridflow.data.tasks import TASKS, build_task, get_task, register_task

__all__ = ["TASKS", "RLDataset", "StatefulDataLoader", "build_task", "collate", "get_task", "register_task"]


def __getattr__(name: str):
    # dataset.py imports torch and the tokenizer stack; load it on first use.
    if name in ("RLDataset", "collate"):
        from hybridflow.data import dataset  # noqa: PLC0415  (lazy: keeps `import hybridflow.data` free of torch and tokenizers)

        return getattr(dataset, name)
    raise AttributeError(f"module 'hybridflow.data' has no attribute {name!r}")
