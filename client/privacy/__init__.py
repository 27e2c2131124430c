"""Patient-level differential privacy at a hospital: DP-SGD with Opacus and its accountant."""

from fedsplit.client.privacy.dpsgd import DPPlan, check_budget, fit_private, plan_noise, spent_epsilon

__all__ = ["DPPlan", "check_budget", "fit_private", "plan_noise", "spent_epsilon"]
