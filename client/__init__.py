"""The hospital agent: Flower ClientApp (`client.app`), models, trainers and data loading."""

# `import client` (its bare folder name) would load every module twice: refused
from fedsplit import only_as_fedsplit

only_as_fedsplit(__name__)
