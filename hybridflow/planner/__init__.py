"""Auto-mapping: run profiles, plan enumeration with memory pruning, and a step-time cost model."""
