"""`kv-bridge demo` (`run`) and its vLLM stand-ins, also used by the tests and
the benchmark: vLLM's wire format (`wire_writer`), its ZMQ publisher with the
replay socket (`publisher`) and a hybrid model's stream of events
(`workload`). The bridge's own run path never imports them."""
