"""Vertical federations end to end: bundled data cut by columns (`datasets`), the Flower run with
its baselines (`experiment`), in-process runs of the same code (`local`) and prediction with a
trained run (`predict`)."""
