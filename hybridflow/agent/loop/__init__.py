"""The in-worker multi-turn agent loop: environments, tools (with a process sandbox), tool-call parsing,
the token-exact loop and its batch."""
