"""Stand-ins for vLLM, for the tests, the benchmark and `kv-bridge demo`: its
wire format (wire_writer), its ZMQ publisher with the replay socket
(publisher), and a hybrid model's stream of events (workload). The bridge's
own run path (service, pipeline, sink) never imports them."""
