"""The hospital agent: Flower ClientApp (`client.app`), models, trainers and data loading."""
