"""What every process of the project runs on, producer or consumer: NATS
access options and credentials (`access`), a local nats-server (`nats_server`),
logging set-up (`logging`), stopping on a signal (`stopping`), the small
HTTP server of the programs' own endpoints (`http`) and giving free memory
back to the system (`memory`). It imports only the contract."""
