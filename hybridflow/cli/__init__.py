"""The `hybridflow` command: one module per subcommand, imported only when it runs (args.py holds what
argparse needs, without torch, transformers or Ray)."""
