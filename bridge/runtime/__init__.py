"""What every process of the project runs on, producer or consumer: NATS
access options and credentials (`access`), a local nats-server (`nats_server`),
logging set-up (`logging`) and stopping on a signal (`stopping`). It imports
only the contract."""
