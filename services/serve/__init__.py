"""`kvpager serve`: an embedded nats-server and the three services as child processes."""
