"""Compatibility with other frameworks' names and defaults."""
