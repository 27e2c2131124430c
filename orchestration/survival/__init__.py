"""Survival runs: the exact federated Cox model and Kaplan-Meier in Flower's simulation engine."""
