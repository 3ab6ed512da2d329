"""A run's configuration: YAML + `a.b=c` overrides -> typed sections (loader.py, the run-level
sections), then the resolve stage (measure.py -> layout.py -> resolve.py): one frozen run with every derived
value filled in."""
