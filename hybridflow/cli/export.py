"""`hybridflow export CKPT_DIR --out HF_DIR [--adapter]`: a checkpoint as a Hugging Face or peft directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridflow.engine.checkpoint import export_adapter, export_hf
from hybridflow.train.checkpointing import actor_dir, model_of, tokenizer_of


def cmd_export(args: argparse.Namespace) -> int:
    """Write a full Hugging Face directory (LoRA adapters merged) or, with --adapter, a peft adapter
    directory from a sharded checkpoint."""

    ckpt = Path(args.ckpt_dir)
    if not ckpt.is_dir():
        raise FileNotFoundError(f"checkpoint directory {ckpt} does not exist")
    base = args.base_model or model_of(ckpt)
    if args.adapter:
        out = export_adapter(actor_dir(ckpt), args.out, base)
    else:
        out = export_hf(actor_dir(ckpt), args.out, tokenizer_of(ckpt, args.tokenizer), base_model=base)
    print(f"exported {out}")
    return 0
