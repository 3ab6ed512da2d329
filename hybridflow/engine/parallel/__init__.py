"""Parallelism applied to one model: the layout of every mesh (dims.py), then tensor parallel, Ulysses
sequence parallel, activation checkpointing and FSDP2 (parallelize.py), and pipeline parallel."""
