"""The coordinator's side of secure aggregation: SecAgg+ on Flower's Message API."""
