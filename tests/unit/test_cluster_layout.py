"""The local cluster's layout (workers/local/broker.py): one block of ports, one rendered config per
node with the replication a real cluster needs, capped for a smaller one. No JVM is started."""

from __future__ import annotations

from pathlib import Path

from workers.local import broker


def properties(path: Path) -> dict[str, str]:
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def test_three_nodes_take_one_block_of_six_ports(tmp_path: Path) -> None:
    layout = broker.ClusterLayout(3, 29100, tmp_path, "cluster-id")
    assert [layout.client_port(n) for n in layout.node_ids] == [29100, 29101, 29102]
    assert [layout.controller_port(n) for n in layout.node_ids] == [29103, 29104, 29105]
    assert layout.bootstrap_servers == "127.0.0.1:29100,127.0.0.1:29101,127.0.0.1:29102"
    assert layout.quorum_voters == "1@127.0.0.1:29103,2@127.0.0.1:29104,3@127.0.0.1:29105"


def test_each_node_renders_its_own_ports_and_the_replication_of_a_real_cluster(
    tmp_path: Path,
) -> None:
    layout = broker.ClusterLayout(3, 29100, tmp_path, "cluster-id")
    node_dir = layout.node_dir(2)
    node_dir.mkdir()
    rendered = broker._render_server_properties(
        node_dir,
        {
            "node.id": "2",
            "listeners": "PLAINTEXT://127.0.0.1:29101,CONTROLLER://127.0.0.1:29104",
            **broker._replication_properties(3),
            "extra.setting": "kept",  # a key the template lacks is appended
        },
    )
    rendered_properties = properties(rendered)
    assert rendered_properties["node.id"] == "2"
    assert rendered_properties["listeners"].endswith(":29104")
    assert rendered_properties["extra.setting"] == "kept"
    assert rendered_properties["default.replication.factor"] == "3"
    assert rendered_properties["min.insync.replicas"] == "2"
    assert rendered_properties["transaction.state.log.replication.factor"] == "3"
    assert rendered_properties["transaction.state.log.min.isr"] == "2"
    assert rendered_properties["offsets.topic.replication.factor"] == "3"


def test_a_two_node_cluster_keeps_one_replica_in_reserve() -> None:
    two = broker._replication_properties(2)
    assert two["default.replication.factor"] == "2"
    assert two["min.insync.replicas"] == "1"
