"""Route modules of the admin API, one per resource."""
