"""A bare Flower 1.42 app of fedsplit's shape: the anchor of bench/deploy_rounds.py."""
