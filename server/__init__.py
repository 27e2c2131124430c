"""The coordinator: Flower ServerApp (`server.app`) and the admin API, thin over `aggregation`."""
