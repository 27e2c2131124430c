"""The coordinator's side of survival analysis: Newton-Raphson for the exact federated Cox
model and the pooled Kaplan-Meier curve, from summed hospital counts and derivatives only."""
