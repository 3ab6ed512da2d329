"""verl's dialect: its config key names and defaults (keys.py, keys_internal.py, dialect.py) and the
generated docs/verl.md (doc.py)."""
