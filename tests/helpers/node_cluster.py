"""A SLURM cluster of several nodes on this machine: each node a network namespace of its own (``mhf-n1``...), joined
to the others by a bridge this helper creates, with its own address, host name and ``slurmd``; one ``slurmctld`` and
``munged`` serve them all from the root namespace. The nodes share the filesystem, as a cluster shares ``/shared``.

Addresses are the test's own (``SUBNET``), reached only through the bridge; nothing is routed beyond it. A
node's ``slurmd`` (and so the tasks it runs) enters the node's network namespace and a mount and host-name namespace
of its own, where the node's name is its host name and ``/etc/netns/<namespace>/hosts`` is mounted over
``/etc/hosts`` to resolve the node names (as ``ip netns exec`` would, without remounting ``/sys``, whose cgroups
SLURM reads). ``stop`` removes
everything (daemons, namespaces, the bridge, the hosts files), also what an earlier test run left.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path

from helpers.slurm import LocalSlurm

SUBNET = "10.231.7"  # /24; the controller is .1, node i is .10+i
BRIDGE = "mhfbr0"
PREFIX = "mhf-"  # namespaces mhf-n1, ...; host-side links mhfv1, ...
NETNS_ETC = Path("/etc/netns")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not all(shutil.which(tool) for tool in ("ip", "unshare", "nsenter")):
        return "no ip, unshare or nsenter command (iproute2, util-linux)"
    probe = subprocess.run(["ip", "netns", "add", f"{PREFIX}probe"], capture_output=True, text=True)
    if probe.returncode:
        return f"ip netns add failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{PREFIX}probe"], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class NodeCluster(LocalSlurm):
    """``nodes`` SLURM nodes ``n1``.. of ``cpus`` CPUs each, each in its own network namespace."""

    controller = f"{socket.gethostname()}({SUBNET}.1)"  # slurmctld runs here, in the root namespace
    slurmd_timeout_s = 10  # a lost node is declared down in seconds, where sites wait minutes

    def __init__(self, root: Path, nodes: int = 3, cpus: int = 2):
        super().__init__(root, cpus)
        self.names = [f"n{i}" for i in range(1, nodes + 1)]

    def nodes(self) -> dict[str, str]:
        return {name: self.address(name) for name in self.names}

    @staticmethod
    def address(node: str) -> str:
        return f"{SUBNET}.{10 + int(node[1:])}"

    @staticmethod
    def namespace(node: str) -> str:
        return f"{PREFIX}{node}"

    def slurmd_command(self, node: str) -> list[str]:
        # its own host name too (srun and the ranks resolve it to the node's address), then slurmd in the foreground
        ns = self.namespace(node)
        return [
            "nsenter",
            f"--net=/run/netns/{ns}",
            "unshare",
            "--mount",
            "--uts",
            "sh",
            "-c",
            f"mount --bind {NETNS_ETC / ns / 'hosts'} /etc/hosts && hostname {node} && "
            f"exec slurmd -D -N {node} -f {self.conf}",
        ]

    def start(self) -> NodeCluster:
        self.remove_network()  # what an earlier run that was killed left
        try:
            self._network()
            return super().start()
        except BaseException:
            self.stop()
            raise

    def _network(self) -> None:
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        hosts = (
            "127.0.0.1 localhost\n"
            + f"{SUBNET}.1 mhfctl\n"
            + "".join(f"{addr} {name}\n" for name, addr in self.nodes().items())
        )
        for i, node in enumerate(self.names, 1):
            ns, link = self.namespace(node), f"mhfv{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", link, "master", BRIDGE, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(hosts)
            (self.root / "spool" / node).mkdir(parents=True, exist_ok=True)

    def link(self, node: str, up: bool) -> None:
        """Take node ``node``'s network link down (it drops off the network) or up again."""
        _ip("link", "set", f"mhfv{self.names.index(node) + 1}", "up" if up else "down")

    def kill_node(self, node: str) -> None:
        """Node ``node`` dies: every process in its namespace (its slurmd and the tasks it runs) is killed."""
        pids = subprocess.run(
            ["ip", "netns", "pids", self.namespace(node)], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def revive(self) -> None:
        """Start again the ``slurmd`` of every node a test killed, and wait until every node is back in service."""
        for node in self.names:
            if not subprocess.run(
                ["ip", "netns", "pids", self.namespace(node)], capture_output=True, text=True
            ).stdout.split():
                self.procs.append(
                    subprocess.Popen(
                        self.slurmd_command(node),
                        env=self.env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
        self.wait_until_up(120)

    def stop_ranks(self, node: str) -> None:
        """The ranks on node ``node`` stop (SIGSTOP: a wedged GPU, a dead data network) while its ``slurmd`` answers."""
        for pid in subprocess.run(
            ["ip", "netns", "pids", self.namespace(node)], capture_output=True, text=True
        ).stdout.split():
            try:
                if b"mhf_dist\x00train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(int(pid), signal.SIGSTOP)
            except (OSError, ProcessLookupError):
                pass

    def stop(self) -> None:
        super().stop()
        for node in self.names:
            self.kill_node(node)
        self.remove_network()

    @staticmethod
    def remove_network() -> None:
        listed = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True
        ).stdout.split("\n")
        for ns in [line.split()[0] for line in listed if line.startswith(PREFIX)]:
            for pid in subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True
            ).stdout.split():
                try:  # a slurmd or task an earlier run left in it
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
        for link in sorted(
            set(re.findall(r"^\d+: (mhfv\d+)@", links, re.M))
        ):  # host ends outliving a namespace
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
