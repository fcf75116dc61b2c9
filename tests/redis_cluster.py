"""A real Redis Cluster on loopback for the tests: 3 masters, each with 1 replica, in a temporary folder.

    cluster = LocalCluster(base_port=7100)
    cluster.start()            # redis-server --cluster-enabled yes × 6, then redis-cli --cluster create
    cluster.url                # redis+cluster://127.0.0.1:7100/0
    cluster.kill(port)         # SIGKILL one node (a master: its replica is promoted)
    cluster.restart(port)      # it rejoins, as a replica
    cluster.stop()

By hand, for a benchmark: `python -m tests.redis_cluster 7100` (Ctrl-C stops it).
Nodes save nothing (--save '' --appendonly no): a killed master's data lives only in its replica.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.cluster import RedisCluster

MASTERS = 3
# Small, so a killed master is failed over within a few seconds (a replica waits about one node
# timeout before it asks for votes).
NODE_TIMEOUT_MS = 1000


def redis_server_missing() -> str | None:
    """Why a cluster cannot be started here, or None."""
    for program in ("redis-server", "redis-cli"):
        if shutil.which(program) is None:
            return f"{program} is not installed (apt-get install redis-server), so no Redis Cluster can be started"
    return None


class LocalCluster:
    def __init__(self, base_port: int = 7100, replicas: int = 1) -> None:
        self.replicas = replicas
        self.ports = [base_port + i for i in range(MASTERS * (1 + replicas))]
        self.folder = Path(tempfile.mkdtemp(prefix="ceiling-cluster-"))
        self.processes: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> None:
        for port in self.ports:
            self._start_node(port)
        for port in self.ports:
            _wait_until(lambda p=port: _answers(p), f"node {port} to answer")
        addresses = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )
        _wait_until(self._healthy, "the cluster to cover every slot with a replica for each master", timeout_s=30)

    def _start_node(self, port: int) -> None:
        log = open(self.folder / f"{port}.log", "wb")  # noqa: SIM115 - closed with the process
        self.processes[port] = subprocess.Popen(
            [
                "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.folder / f"nodes-{port}.conf"),
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--dir", str(self.folder),
                "--save", "", "--appendonly", "no",
                # A replica's first copy starts at once, not after the default 5 s wait for others.
                "--repl-diskless-sync-delay", "0",
            ],
            stdout=log, stderr=subprocess.STDOUT,
        )

    def _healthy(self) -> bool:
        for port in self.alive_ports():
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                if client.cluster("info").get("cluster_state") != "ok":
                    return False
            finally:
                client.close()
        return len(self.masters()) == MASTERS and all(self._replica_of(m) for m in self.masters())

    def alive_ports(self) -> list[int]:
        return [port for port, process in self.processes.items() if process.poll() is None]

    def masters(self) -> list[int]:
        return [port for port in self.alive_ports() if _role(port) == "master"]

    def _replica_of(self, master_port: int) -> bool:
        info = redis.Redis(port=master_port, socket_timeout=1).info("replication")
        online = [info[f"slave{i}"] for i in range(info.get("connected_slaves", 0)) if info[f"slave{i}"]["state"] == "online"]
        return len(online) >= self.replicas  # synced, not still waiting for its first copy

    def master_of_key(self, key: str) -> int:
        client = RedisCluster(host="127.0.0.1", port=self.alive_ports()[0])
        try:
            return int(client.get_node_from_key(key).port)
        finally:
            client.close()

    def replica_of(self, master_port: int) -> int:
        return int(redis.Redis(port=master_port, socket_timeout=1).info("replication")["slave0"]["port"])

    def hand_over(self, master_port: int) -> int:
        """A planned failover (CLUSTER FAILOVER on the replica, which first catches up): the old
        master becomes its replica and answers MOVED for its former slots. The new master's port."""
        replica = self.replica_of(master_port)
        redis.Redis(port=replica, socket_timeout=5).cluster("failover")
        _wait_until(lambda: _role(replica) == "master" and self._healthy(), f"node {replica} to take over", 30)
        return replica

    def pause(self, port: int) -> None:
        """SIGSTOP: the node stays listed in the cluster but answers nothing, a replica that lags."""
        self.processes[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        self.processes[port].send_signal(signal.SIGCONT)
        _wait_until(self._healthy, f"node {port} to catch up", timeout_s=30)

    def kill(self, port: int) -> None:
        self.processes[port].send_signal(signal.SIGKILL)
        self.processes[port].wait(10)

    def restart(self, port: int) -> None:
        """A killed node started again with its nodes file: it rejoins as its successor's replica."""
        self._start_node(port)
        _wait_until(self._healthy, f"node {port} to rejoin as a replica", timeout_s=30)

    def wait_for_failover(self, killed: int, timeout_s: float = 30) -> None:
        """Until a replica took over the killed master's slots and every live node says ok."""
        def failed_over() -> bool:
            return len(self.masters()) == MASTERS and all(
                redis.Redis(port=p, socket_timeout=1).cluster("info").get("cluster_state") == "ok"
                for p in self.alive_ports()
            )
        _wait_until(failed_over, f"a replica to replace the master on {killed}", timeout_s)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(self.folder, ignore_errors=True)


def _answers(port: int) -> bool:
    try:
        return redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5).ping()
    except redis.RedisError:
        return False


def _role(port: int) -> str:
    try:
        return redis.Redis(port=port, socket_timeout=1).info("replication")["role"]
    except redis.RedisError:
        return "down"


def _wait_until(condition, what: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except redis.RedisError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"gave up waiting for {what}")


def main() -> None:
    """`python -m tests.redis_cluster [BASE_PORT]`: a cluster for a benchmark by hand, until Ctrl-C."""
    import sys

    cluster = LocalCluster(int(sys.argv[1]) if len(sys.argv) > 1 else 7100)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # kill PID stops the nodes too
    cluster.start()
    print(f"CEILING_COUNTERS_URL={cluster.url}  (masters {cluster.masters()}; Ctrl-C stops it)", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
