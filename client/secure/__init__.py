"""The hospital's side of secure aggregation (SecAgg+ on Flower's primitives)."""
