"""Patient-level differential privacy at a hospital: DP-SGD with Opacus, and the hospital's own
privacy ledger (`client.privacy.ledger`) that accounts for it across runs."""

from fedsplit.client.privacy.dpsgd import DPPlan, fit_private, plan_noise

__all__ = ["DPPlan", "fit_private", "plan_noise"]
