"""The vertical coordinator (label holder): the Flower ServerApp (`server.vertical.app`), the
transport-independent `VerticalCoordinator` and the fusion head it trains."""
