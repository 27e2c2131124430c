"""The admin API's logic, called by thin route handlers; raises fedsplit errors only."""
