"""The cluster harness starts again on new ports when a port it picked free
is taken before its server binds it (seen in a full run: `bind: address
already in use` on a route port, while the suite's other processes ran)."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.cluster.harness import NatsCluster


def test_a_taken_route_port_makes_the_cluster_start_on_new_ports(tmp_path: Path) -> None:
    cluster = NatsCluster(tmp_path / "cluster")
    taken = cluster.nodes[0].cluster_port
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the harness holds its ports in TIME_WAIT
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        cluster.start()
        try:
            assert all(n.alive() for n in cluster.nodes)
            assert taken not in {n.cluster_port for n in cluster.nodes}
            assert "address already in use" in (tmp_path / "cluster" / "n1.log").read_text()
        finally:
            cluster.stop()
