"""The coordinator: Flower ServerApp (`server.app`) and the admin API, thin over `aggregation`."""

# `import server` (its bare folder name) would load every module twice: refused
from fedsplit import only_as_fedsplit

only_as_fedsplit(__name__)
