"""Helpers more than one test folder uses (not tests themselves)."""
