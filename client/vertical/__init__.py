"""A vertical feature site: its table and preprocessing, its branch, its side of every exchange,
and the Flower ClientApp around it (`client.vertical.app`)."""
