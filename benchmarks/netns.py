"""A slow network on one machine: N network namespaces on a shaped bridge (root only; not part of the test gate).

Each worker gets its own network namespace ``<tag>-w<i>`` holding one end of a veth pair (``<tag>w<i>``, address
``<subnet>.<i+1>/24``); the other end (``<tag>b<i>``) sits in a bridge namespace ``<tag>-br`` on a bridge. Nothing
is created in, or routed through, the root namespace: the addresses exist only inside these namespaces, there is
no default route, and a packet can only reach another worker of the same cluster. Both ends of every veth are
shaped with ``tc qdisc ... tbf rate R burst B latency L``: the worker's end limits what it sends, the bridge's end
limits what it receives (measured: 95.8 Mbit/s for 100mbit this way; ``netem`` does not exist in this
kernel, so no propagation delay or loss is added: latency is what the stack and the tbf queue give).

Usage::

    with NetnsCluster(4, rate_mbit=100) as net:
        p = net.popen(0, ["python", "-c", "..."], env={"GLOO_SOCKET_IFNAME": net.ifnames[0]})
        net.set_rate(10)                     # reshape every link in place
        print(net.measure_throughput(0, 1))  # {'mbit_per_s': 95.8, ...}
        print(net.counters(0))               # veth byte counters of worker 0

For ``torch.distributed`` (Gloo) inside the namespaces: ``GLOO_SOCKET_IFNAME=<net.ifnames[i]>`` for worker ``i`` and
``MASTER_ADDR=<net.addrs[0]>`` (the TCPStore lives in worker 0's namespace); :meth:`NetnsCluster.dist_env` builds
that environment.

Teardown (kill the processes started here, delete the namespaces, which removes the veths and the bridge) runs on
``__exit__``, at interpreter exit (``atexit``) and on SIGTERM/SIGHUP. ``python -m benchmarks.netns --cleanup``
removes namespaces a killed run left behind; ``python -m benchmarks.netns`` measures the shaping at 10, 100 and
1000 Mbit/s and writes ``benchmarks/results/netns.json``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

__all__ = ["NetnsCluster", "cleanup", "confine_training_thread", "PREFIX"]

PREFIX = "fgdb"  # every namespace this module creates starts with it
RESULTS = Path(__file__).resolve().parent / "results"

_LIVE: list[NetnsCluster] = []
#: with ``quota_training_thread`` a worker inherits these descriptors, open for writing on the ``tasks`` files of its
#: training-thread cgroup (the quota) and of the cgroup its other threads run in (``ip netns exec`` mounts a /sys of
#: the namespace's own, without the cgroups, so they are opened before it)
TRAINING_FD, OTHER_FD = 7, 8
#: environment variable that says a worker has them
APART = "FGDILOCO_BENCH_THREADS_APART"


def _ip(*args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=timeout)


def _sh(argv: list[str], check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _cpu_cgroup(name: str, cpus: float | None, period_us: int = 100_000, *, per_thread: bool = False) -> Path:
    """A CPU cgroup ``name`` whose processes together get at most ``cpus`` cores (CFS bandwidth control; None: no
    limit), made fresh; cgroup v2 (``cpu.max``) where the unified hierarchy has the cpu controller, else v1's cpu
    hierarchy. ``per_thread``: threads of one process will be placed in different cgroups (cgroup v1 only, whose
    ``tasks`` file moves single threads)."""
    quota = -1 if cpus is None else max(1000, int(cpus * period_us))
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
    controllers = v2 / "cgroup.controllers"
    if controllers.is_file() and "cpu" in controllers.read_text().split():
        if per_thread:
            raise RuntimeError("quota_training_thread needs cgroup v1's cpu hierarchy (its tasks file moves single "
                               "threads); this machine has cgroup v2")
        cg = v2 / name
        cg.mkdir(exist_ok=True)
        (cg / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {period_us}")
        return cg
    if not (v1 / "cpu.cfs_quota_us").is_file():
        raise RuntimeError("cpus_per_worker needs CFS bandwidth control (cgroup v1 cpu or v2 cpu.max), found none")
    cg = v1 / name
    cg.mkdir(exist_ok=True)
    (cg / "cpu.cfs_period_us").write_text(str(period_us))
    (cg / "cpu.cfs_quota_us").write_text(str(quota))
    return cg


def existing_namespaces(prefix: str = PREFIX) -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip().startswith(prefix)]


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace whose name starts with ``prefix`` (left behind by a killed run)."""
    gone = []
    for ns in existing_namespaces(prefix):
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:  # processes still inside a namespace we created
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", ns, check=False)
        gone.append(ns)
    return gone


def confine_training_thread(poll_seconds: float = 0.002) -> bool:
    """Put the calling thread alone under the worker's quota (``NetnsCluster(quota_training_thread=True)``).

    Call it from the thread that will run the inner steps, in a process :meth:`NetnsCluster.popen` started (the
    process starts in the worker's cgroup without a limit). A daemon thread then keeps every other thread out of
    the quota: a thread inherits the cgroup of the thread that made it, so each thread the training thread starts
    is moved out within ``poll_seconds`` (what it ran until then counts against the quota). Returns False, doing
    nothing, outside such a cluster."""
    if os.environ.get(APART) != "1":
        return False
    import threading

    me = threading.get_native_id()
    ready = threading.Event()

    def keep_apart() -> None:
        placed = {me, threading.get_native_id()}
        ready.set()
        while True:
            for name in os.listdir("/proc/self/task"):
                tid = int(name)
                if tid not in placed:
                    placed.add(tid)
                    with contextlib.suppress(OSError):  # a thread that has already ended
                        os.write(OTHER_FD, f"{tid}\n".encode())
            time.sleep(poll_seconds)

    threading.Thread(target=keep_apart, name="fgdiloco-bench-keep-apart", daemon=True).start()
    ready.wait()
    os.write(TRAINING_FD, f"{me}\n".encode())
    return True


def _teardown_all() -> None:
    for c in list(_LIVE):
        with contextlib.suppress(Exception):
            c.down()


def _on_signal(signum: int, frame: Any) -> None:
    _teardown_all()
    raise SystemExit(128 + signum)


_HANDLERS_INSTALLED = False


def _install_handlers() -> None:
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED:
        return
    _HANDLERS_INSTALLED = True
    atexit.register(_teardown_all)
    import threading

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError, OSError):
                if signal.getsignal(sig) in (signal.SIG_DFL, None):
                    signal.signal(sig, _on_signal)


class NetnsCluster:
    """``n`` network namespaces joined by tbf-shaped veth pairs to one bridge (in its own namespace).

    Args:
        n: number of worker namespaces (1-250).
        rate_mbit: link rate of every veth end, in Mbit/s (tbf ``rate``).
        tag: name prefix of this cluster's namespaces and interfaces (``PREFIX`` + a number by default; at most
            8 characters so interface names stay below 15).
        subnet: the first three octets of the /24 used inside the namespaces (private range; it exists only
            there).
        burst: tbf ``burst`` (bytes, or None for ``max(64 KiB, rate × 4 ms)``).
        latency_ms: tbf ``latency``: the longest a packet may wait in the shaper's queue (sets the queue size).
        cpus_per_worker: CPU cores each worker namespace's processes may use together (a CFS quota per worker:
            cgroup v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``), or None for no limit. With more workers than cores
            an unlimited worker that waits for the network lends its core to the others, so waiting costs a method
            less here than on a host of its own; a quota takes that loan away: each worker is a host of
            ``cpus_per_worker`` cores.
        quota_training_thread: with ``cpus_per_worker``, the quota holds each worker's training thread only (its
            main thread, the one that runs the inner steps); every other thread of the worker (gossip, Gloo's,
            torchft's manager) runs in a second cgroup of the worker's without a limit, as on a GPU host whose spare
            CPU cores carry the communication while the inner steps run on the GPU. The worker process places its
            threads itself: :func:`confine_training_thread`. cgroup v1 only.
    """

    def __init__(self, n: int, rate_mbit: float = 100.0, *, tag: str | None = None, subnet: str = "10.213.0",
                 burst: int | None = None, latency_ms: float = 50.0, cpus_per_worker: float | None = None,
                 quota_training_thread: bool = False):
        if not 1 <= n <= 250:
            raise ValueError(f"n must be in [1, 250], got {n}")
        if cpus_per_worker is not None and not 0.01 <= cpus_per_worker <= (os.cpu_count() or 1):
            raise ValueError(f"cpus_per_worker must be None or in [0.01, {os.cpu_count()}] cores, got "
                             f"{cpus_per_worker!r}")
        if quota_training_thread and cpus_per_worker is None:
            raise ValueError("quota_training_thread needs cpus_per_worker (the training thread's quota)")
        parts = subnet.split(".")
        if len(parts) != 3 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
            raise ValueError(f"subnet must be three octets like '10.213.0', got {subnet!r}")
        first, second = int(parts[0]), int(parts[1])
        if not (first == 10 or (first == 192 and second == 168) or (first == 172 and 16 <= second <= 31)):
            raise ValueError(f"subnet {subnet!r} is not a private (RFC 1918) range")
        self.n = n
        self.tag = tag or f"{PREFIX}{os.getpid() % 10000}"
        if not self.tag.startswith(PREFIX) or len(self.tag) > 8:
            raise ValueError(f"tag must start with {PREFIX!r} and have at most 8 characters, got {self.tag!r}")
        self.subnet = subnet
        self.rate_mbit = float(rate_mbit)
        self.burst = burst
        self.latency_ms = float(latency_ms)
        self.bridge_ns = f"{self.tag}-br"
        self.names = [f"{self.tag}-w{i}" for i in range(n)]
        self.ifnames = [f"{self.tag}w{i}" for i in range(n)]
        self.bridge_ifnames = [f"{self.tag}b{i}" for i in range(n)]
        self.addrs = [f"{subnet}.{i + 1}" for i in range(n)]
        self.cpus_per_worker = cpus_per_worker
        self.quota_training_thread = quota_training_thread
        self.cgroups: list[Path] = []
        self.other_cgroups: list[Path] = []  # quota_training_thread: where the workers' other threads run
        self._procs: list[subprocess.Popen] = []
        self._up = False

    # ------------------------------------------------------------------ lifecycle
    def up(self) -> NetnsCluster:
        """Create the namespaces, veths, bridge, addresses and shapers."""
        if self._up:
            return self
        _install_handlers()
        cleanup(self.tag + "-")  # leftovers of a killed run with the same tag
        _LIVE.append(self)
        self._up = True
        try:
            br = self.bridge_ns
            _ip("netns", "add", br)
            _ip("-n", br, "link", "set", "lo", "up")
            _ip("-n", br, "link", "add", "br0", "type", "bridge")
            _ip("-n", br, "link", "set", "br0", "up")
            for ns, wif, bif, addr in zip(self.names, self.ifnames, self.bridge_ifnames, self.addrs):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                # created directly inside the two namespaces: nothing ever appears in the root namespace
                _ip("link", "add", wif, "netns", ns, "type", "veth", "peer", "name", bif, "netns", br)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", wif)
                _ip("-n", ns, "link", "set", wif, "up")
                _ip("-n", br, "link", "set", bif, "master", "br0")
                _ip("-n", br, "link", "set", bif, "up")
            self.set_rate(self.rate_mbit)
            if self.cpus_per_worker is not None:
                apart = self.quota_training_thread
                self.cgroups = [_cpu_cgroup(ns, self.cpus_per_worker, per_thread=apart) for ns in self.names]
                if apart:
                    self.other_cgroups = [_cpu_cgroup(f"{ns}-other", None, per_thread=True) for ns in self.names]
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Kill the processes started here, then delete every namespace of this cluster (idempotent)."""
        for p in self._procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)  # each was started in its own session: pgid == pid
        for p in self._procs:
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
        self._procs = []
        for cg in self.cgroups + self.other_cgroups:
            with contextlib.suppress(OSError):  # empty once its processes are gone
                cg.rmdir()
        self.cgroups, self.other_cgroups = [], []
        if self._up:
            cleanup(self.tag + "-")
            self._up = False
        if self in _LIVE:
            _LIVE.remove(self)

    def __enter__(self) -> NetnsCluster:
        return self.up()

    def __exit__(self, *exc: Any) -> None:
        self.down()

    # ------------------------------------------------------------------ shaping
    def tbf_args(self, rate_mbit: float) -> list[str]:
        burst = self.burst if self.burst is not None else max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.004))
        return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", f"{self.latency_ms:g}ms"]

    def set_rate(self, rate_mbit: float) -> None:
        """Shape both ends of every veth to ``rate_mbit`` (``tc qdisc replace``: works on live links)."""
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        tbf = self.tbf_args(rate_mbit)
        for ns, wif, bif in zip(self.names, self.ifnames, self.bridge_ifnames):
            _sh(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", wif, "root", *tbf])
            _sh(["ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "replace", "dev", bif, "root", *tbf])
        self.rate_mbit = float(rate_mbit)

    def qdiscs(self, i: int = 0) -> str:
        """``tc qdisc show`` of worker ``i``'s veth (both ends), for the record."""
        a = _sh(["ip", "netns", "exec", self.names[i], "tc", "qdisc", "show", "dev", self.ifnames[i]]).stdout
        b = _sh(["ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "show", "dev",
                 self.bridge_ifnames[i]]).stdout
        return (a.strip() + " | " + b.strip()).strip()

    # ------------------------------------------------------------------ running things inside
    def argv(self, i: int, argv: list[str], *, quota: bool = True) -> list[str]:
        """``argv`` run inside worker ``i``'s namespace and, with ``cpus_per_worker`` and ``quota``, its CPU
        cgroup (entered before ``exec``, so every thread and child the process makes is in it too; with
        ``quota_training_thread`` the cgroup without a limit, and the process moves its training thread)."""
        inside = ["ip", "netns", "exec", self.names[i], *argv]
        if not (quota and self.cgroups):
            return inside
        if not self.other_cgroups:
            return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroups[i] / "cgroup.procs"), *inside]
        return ["sh", "-c", f'echo $$ > "$0" && exec {TRAINING_FD}>"$1" {OTHER_FD}>"$2" && shift 2 && exec "$@"',
                str(self.other_cgroups[i] / "cgroup.procs"), str(self.cgroups[i] / "tasks"),
                str(self.other_cgroups[i] / "tasks"), *inside]

    def dist_env(self, i: int, port: int = 29500) -> dict[str, str]:
        """torchrun-style environment for worker ``i`` of an ``n``-rank Gloo job across the namespaces."""
        return {"RANK": str(i), "LOCAL_RANK": "0", "WORLD_SIZE": str(self.n), "LOCAL_WORLD_SIZE": "1",
                "GROUP_RANK": str(i), "MASTER_ADDR": self.addrs[0], "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": self.ifnames[i], "TP_SOCKET_IFNAME": self.ifnames[i]}

    def popen(self, i: int, argv: list[str], *, env: dict[str, str] | None = None, quota: bool = True,
              **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside worker ``i``'s namespace (own session; killed by :meth:`down`); ``quota``: in its
        CPU cgroup too, when the cluster has ``cpus_per_worker``."""
        full_env = dict(os.environ)
        full_env.update(env or {})
        if quota and self.other_cgroups:
            full_env[APART] = "1"
        p = subprocess.Popen(self.argv(i, argv, quota=quota), env=full_env, start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def run(self, i: int, argv: list[str], *, timeout: float = 60.0, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        """Run ``argv`` inside worker ``i``'s namespace and wait (at most ``timeout`` seconds)."""
        p = self.popen(i, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def counters(self, i: int) -> dict[str, int]:
        """Byte and packet counters of worker ``i``'s veth (seen from inside its namespace; IP + TCP headers
        included): what the worker put on, and took off, the wire."""
        r = _ip("-n", self.names[i], "-s", "-j", "link", "show", "dev", self.ifnames[i])
        st = json.loads(r.stdout)[0]["stats64"]
        return {"tx_bytes": st["tx"]["bytes"], "rx_bytes": st["rx"]["bytes"], "tx_packets": st["tx"]["packets"],
                "rx_packets": st["rx"]["packets"], "tx_dropped": st["tx"]["dropped"]}

    # ------------------------------------------------------------------ checks
    def measure_throughput(self, src: int = 0, dst: int = 1, seconds: float = 2.0, port: int = 5201) -> dict:
        """One TCP stream from worker ``src`` to ``dst`` for ``seconds``: goodput at the receiver (an iperf-like
        check that the shaping gives the rate asked for)."""
        recv = textwrap.dedent(f"""
            import socket, time, json
            s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("{self.addrs[dst]}", {port})); s.listen(1); s.settimeout(30)
            c, _ = s.accept(); c.settimeout(30)
            n = 0; t0 = None; t1 = None
            while True:
                b = c.recv(1 << 20)
                if not b:
                    break
                now = time.perf_counter()
                if t0 is None:
                    t0 = now
                else:
                    n += len(b)
                t1 = now
            print(json.dumps({{"bytes": n, "seconds": t1 - t0}}))
        """)
        send = textwrap.dedent(f"""
            import socket, time
            for _ in range(100):
                try:
                    c = socket.create_connection(("{self.addrs[dst]}", {port}), timeout=10); break
                except OSError:
                    time.sleep(0.05)
            buf = b"\\x5a" * (1 << 16); end = time.perf_counter() + {seconds}
            while time.perf_counter() < end:
                c.sendall(buf)
            c.close()
        """)
        rp = self.popen(dst, [sys.executable, "-c", recv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        text=True)
        try:
            sp = self.run(src, [sys.executable, "-c", send], timeout=seconds + 40)
            if sp.returncode:
                raise RuntimeError(f"throughput sender failed: {sp.stderr.strip()}")
            out, err = rp.communicate(timeout=40)
        finally:
            if rp.poll() is None:
                os.killpg(rp.pid, signal.SIGKILL)
        if rp.returncode:
            raise RuntimeError(f"throughput receiver failed: {err.strip()}")
        r = json.loads(out.strip().splitlines()[-1])
        mbit = 8 * r["bytes"] / r["seconds"] / 1e6
        return {"src": src, "dst": dst, "asked_mbit_per_s": self.rate_mbit, "mbit_per_s": round(mbit, 2),
                "ratio_to_asked": round(mbit / self.rate_mbit, 4), "bytes": r["bytes"],
                "seconds": round(r["seconds"], 3)}

    def measure_rtt(self, src: int = 0, dst: int = 1, n: int = 200, port: int = 5202) -> dict:
        """Median round trip of a 1-byte TCP ping-pong between two workers, in milliseconds."""
        server = textwrap.dedent(f"""
            import socket
            s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("{self.addrs[dst]}", {port})); s.listen(1); s.settimeout(30)
            c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                b = c.recv(1)
                if not b:
                    break
                c.sendall(b)
        """)
        client = textwrap.dedent(f"""
            import socket, time, statistics, json
            for _ in range(100):
                try:
                    c = socket.create_connection(("{self.addrs[dst]}", {port}), timeout=10); break
                except OSError:
                    time.sleep(0.05)
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ts = []
            for _ in range({n}):
                t0 = time.perf_counter(); c.sendall(b"x"); c.recv(1); ts.append(time.perf_counter() - t0)
            c.close()
            print(json.dumps({{"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts)}}))
        """)
        sp_ = self.popen(dst, [sys.executable, "-c", server], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            cp = self.run(src, [sys.executable, "-c", client], timeout=60)
            if cp.returncode:
                raise RuntimeError(f"rtt client failed: {cp.stderr.strip()}")
        finally:
            with contextlib.suppress(Exception):
                sp_.wait(timeout=10)
            if sp_.poll() is None:
                os.killpg(sp_.pid, signal.SIGKILL)
        r = json.loads(cp.stdout.strip().splitlines()[-1])
        return {"src": src, "dst": dst, "median_ms": round(r["median_ms"], 3), "min_ms": round(r["min_ms"], 3)}

    def isolation_check(self) -> dict:
        """What a worker namespace can reach: its routes (only the cluster's /24) and that an address outside the
        cluster is unreachable (connect fails at once: no route). Proof that traffic cannot leave."""
        routes = _ip("-n", self.names[0], "route", "show").stdout.strip().splitlines()
        probe = ("import socket\ntry:\n socket.create_connection(('192.0.2.1', 9), timeout=1)\n print('reached')\n"
                 "except OSError as e:\n print(type(e).__name__, e.errno)")
        r = self.run(0, [sys.executable, "-c", probe], timeout=20)
        return {"routes_in_worker_ns": routes, "outside_probe": r.stdout.strip()}


def shaping_check(rates: list[float], n: int = 2, seconds: float = 2.0) -> dict:
    """Measure TCP goodput between two namespaces at each rate (and the idle RTT once)."""
    out: dict[str, Any] = {"rates": []}
    with NetnsCluster(max(n, 2), rate_mbit=rates[0]) as net:
        out["isolation"] = net.isolation_check()
        out["rtt"] = net.measure_rtt()
        for r in rates:
            net.set_rate(r)
            m = net.measure_throughput(0, 1, seconds=seconds)
            m["qdisc"] = net.qdiscs(0)
            out["rates"].append(m)
            print(f"  asked {r:g} Mbit/s: measured {m['mbit_per_s']:.1f} Mbit/s ({100 * m['ratio_to_asked']:.1f} %)",
                  flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cleanup", action="store_true", help=f"delete namespaces named {PREFIX}* and exit")
    ap.add_argument("--rates", default="10,100,1000", help="Mbit/s to check (comma separated)")
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("network namespaces need root")
    if args.cleanup:
        print("removed:", cleanup() or "nothing")
        return
    res = shaping_check([float(x) for x in args.rates.split(",")], seconds=args.seconds)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "netns.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
