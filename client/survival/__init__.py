"""Survival analysis at a hospital: time/event data, the Cox partial likelihood's per-hospital
gradient and Hessian, Kaplan-Meier counts, and the bundled FLamby Fed-TCGA-BRCA data."""
