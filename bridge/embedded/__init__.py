"""What a newcomer gets without infrastructure: a local nats-server and a demo publisher."""
