"""A small namespace topology for the allreduce tests: H host namespaces and M DPU namespaces joined
by a Linux bridge in a fabric namespace, optional loss/duplication on every link (testbed.impair's
tc BPF program: this kernel has no netem), DPU workers and host processes started inside them.

Everything is created through the ``netns_factory`` fixture, so all of it is deleted at teardown
(processes are killed with their namespaces), also when a test fails.
"""
from __future__ import annotations

import json
import os
import uuid
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dosa.auth import make_files
from dosa.job import JobConfig

ROOT = Path(__file__).resolve().parents[2]
HOST_MAIN = Path(__file__).with_name("allreduce_host.py")
PORT = 17791
CONTROL_PORT = 17800


def _in_ns(ns: str) -> list[str]:
    """Enter only the network namespace: ``ip netns exec`` would also remount /sys and hide the
    bpffs where the control plane pins the dataplane's maps from the DPU worker."""
    return ["nsenter", f"--net=/run/netns/{ns}", "--"]


def _run(*argv, check=True):
    p = subprocess.run(list(argv), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {p.stderr.strip()}")
    return p


class Lab:
    def __init__(self, netns_factory, hosts: int = 4, dpus: int = 1, loss_pct: float = 0.0,
                 dup_pct: float = 0.0, subnet: str = "10.231.7"):
        self.tmp = Path(tempfile.mkdtemp(prefix="dosa-lab-"))
        self.fab = netns_factory("fab")
        _run("ip", "-n", self.fab, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.fab, "link", "set", "br0", "up")
        self.host_ns, self.dpu_ns = [], []
        self.host_addr = [f"{subnet}.{10 + i}" for i in range(hosts)]
        self.dpu_addr = [f"{subnet}.{100 + d}" for d in range(dpus)]
        self.ports: list[str] = []
        for kind, addrs, lst in (("h", self.host_addr, self.host_ns), ("d", self.dpu_addr, self.dpu_ns)):
            for i, a in enumerate(addrs):
                ns = netns_factory(f"{kind}{i}")
                port = f"p{kind}{i}"
                _run("ip", "-n", self.fab, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                     "netns", ns)
                _run("ip", "-n", self.fab, "link", "set", port, "master", "br0", "up")
                _run("ip", "-n", ns, "addr", "add", f"{a}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                self.ports.append(port)
                lst.append(ns)
        self._impaired = False
        if loss_pct or dup_pct:
            self.impair(loss_pct, dup_pct)
        self.procs: list[subprocess.Popen] = []
        self.pin_dirs: list[str] = []
        self.ctl_procs: list[subprocess.Popen] = []
        # the control planes take signed calls only: the DPUs' file for them, the hosts' for the hosts
        self.dpu_secret, self.host_secret = str(self.tmp / "dpu.secret"), str(self.tmp / "host.secret")
        make_files(self.dpu_secret, self.host_secret)

    def impair(self, loss_pct: float, dup_pct: float) -> None:
        """Random loss/duplication on every link, both directions (testbed.impair); 0, 0 removes it."""
        from testbed import impair
        from testbed.shaping import Shaping

        if self._impaired:
            for port in self.ports:
                _run("tc", "-n", self.fab, "qdisc", "del", "dev", port, "clsact", check=False)
            self._impaired = False
        if loss_pct or dup_pct:
            obj = impair.build(Shaping(loss_pct=loss_pct, dup_pct=dup_pct), self.tmp)
            for port in self.ports:
                impair.attach(self.fab, port, obj)
            for ns in (*self.host_ns, *self.dpu_ns):  # loss per packet, not per GSO datagram
                impair.segment_at_node(ns, "eth0")
            self._impaired = True

    def job(self, job_id=5, numel=200_000, partition_size=16384, mode="sum", density=0.01,
            scale_exp=10) -> JobConfig:
        return JobConfig(job_id=job_id, numel=numel, hosts=[(a, PORT) for a in self.host_addr],
                         dpus=[(a, PORT) for a in self.dpu_addr], partition_size=partition_size,
                         mode=mode, density=density, scale_exp=scale_exp)

    def write_job(self, job: JobConfig) -> str:
        path = str(self.tmp / f"job{job.job_id}.json")
        job.save(path)
        return path

    def _env(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["DOSA_SECRET_FILE"], env["DOSA_CONTROL_CA"] = self.host_secret, ""
        return env

    def start_dpu(self, d: int, job_file: str, mode: str = "userspace", extra=()) -> subprocess.Popen:
        argv = [*_in_ns(self.dpu_ns[d]), sys.executable, "-m", "dosa", "dpu", "run",
                "--mode", mode, "--job-config", job_file, "--dpu-index", str(d), *extra]
        log = open(self.tmp / f"dpu{d}.log", "a")
        p = subprocess.Popen(argv, cwd=ROOT, env=self._env(), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        self._wait_bound(self.dpu_ns[d], PORT, p)
        return p

    def start_control(self, d: int, mode: str = "xdp", pool_buffers: int | None = None) -> subprocess.Popen:
        """The control plane of DPU d (``dosa ctl serve``): attaches the XDP dataplane to the DPU's
        eth0 under a pin directory of its own and serves the join API."""
        pin = f"/sys/fs/bpf/dosatest-{uuid.uuid4().hex[:8]}-d{d}"
        self.pin_dirs.append(pin)
        a = self.dpu_addr[d]
        argv = [*_in_ns(self.dpu_ns[d]), sys.executable, "-m", "dosa", "ctl", "serve",
                "--instance", pin, "--iface", "eth0", "--addr", a, "--listen", f"{a}:{CONTROL_PORT}",
                "--port", str(PORT), "--mode", mode, "--secret-file", self.dpu_secret,
                *(["--pool-buffers", str(pool_buffers)] if pool_buffers else [])]
        log = open(self.tmp / f"ctl{d}.log", "a")
        p = subprocess.Popen(argv, cwd=ROOT, env=self._env(), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        self.ctl_procs.append(p)
        self._wait_bound(self.dpu_ns[d], CONTROL_PORT, p, proto="t", timeout=60)
        return p

    def start_dpu_control(self, d: int, mode: str = "xdp", control_dpu: int | None = None, extra=()):
        """The DPU worker, learning its jobs from the control plane of DPU ``control_dpu`` (default:
        its own; in userspace mode only the one the hosts join through knows the job); ``extra``:
        more ``dosa dpu run`` arguments (e.g. --workers 2)."""
        a = self.dpu_addr[d]
        c = self.dpu_addr[d if control_dpu is None else control_dpu]
        argv = [*_in_ns(self.dpu_ns[d]), sys.executable, "-m", "dosa", "dpu", "run",
                "--mode", mode, "--instance", self.pin_dirs[d], "--addr", a, "--port", str(PORT),
                "--control", f"{c}:{CONTROL_PORT}", "-v", *extra]
        log = open(self.tmp / f"dpu{d}.log", "a")
        p = subprocess.Popen(argv, cwd=ROOT, env=self._env(), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        self.procs.append(p)
        self._wait_bound(self.dpu_ns[d], PORT, p)
        return p

    def control_args(self, job_id=5, numel=200_000, partition_size=16384, mode="sum", density=0.01,
                     scale_exp=10, dpus=None, slots=None) -> list[str]:
        """Host arguments to join through DPU 0's control plane with this job shape (``dpus``: how
        many of the lab's DPUs the job uses, default all; ``slots``: default the job's default)."""
        shape = {"numel": numel, "workers": len(self.host_ns), "dpus": self.dpu_addr[:dpus],
                 "partition_size": partition_size, "mode": mode, "density": density,
                 "scale_exp": scale_exp, **({"slots": slots} if slots else {})}
        return ["--control", f"{self.dpu_addr[0]}:{CONTROL_PORT}", "--job-id", str(job_id),
                "--shape", json.dumps(shape)]

    def _wait_bound(self, ns: str, port: int, p: subprocess.Popen, timeout: float = 20.0,
                    proto: str = "u") -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if p.poll() is not None:
                raise RuntimeError(f"process exited with {p.returncode}: {self.logs()}")
            out = _run("ip", "netns", "exec", ns, "ss", f"-H{proto}nl", f"sport = :{port}",
                       check=False).stdout
            if out.strip():
                return
            time.sleep(0.05)
        raise RuntimeError("DPU worker did not bind in time")

    def start_hosts(self, job_file: str | None, extra=(), per_host=None) -> list[subprocess.Popen]:
        """Start every host; ``job_file`` None: they join through the control plane (``extra``
        carries control_args())."""
        ps = []
        for w, ns in enumerate(self.host_ns):
            more = list(per_host(w)) if per_host else []
            cfg = ["--job-config", job_file] if job_file else []
            out = self.tmp / f"host{w}.json"
            if out.exists():
                out.unlink()
            argv = [*_in_ns(ns), sys.executable, str(HOST_MAIN), *cfg,
                    "--worker-id", str(w), "--out", str(out), *extra, *more]
            log = open(self.tmp / f"host{w}.log", "w")
            p = subprocess.Popen(argv, cwd=ROOT, env=self._env(), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            self.procs.append(p)
            ps.append(p)
        return ps

    def wait_hosts(self, ps, timeout: float) -> list[dict]:
        end = time.monotonic() + timeout
        for p in ps:
            try:
                p.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise AssertionError(f"hosts did not finish in {timeout} s: {self.logs()}")
        out = []
        for w in range(len(ps)):
            f = self.tmp / f"host{w}.json"
            out.append(json.loads(f.read_text()) if f.exists() else {"exit": ps[w].returncode})
        return out

    def run_hosts(self, job_file: str, timeout: float, extra=(), per_host=None) -> list[dict]:
        return self.wait_hosts(self.start_hosts(job_file, extra, per_host), timeout)

    def logs(self) -> str:
        parts = []
        for f in sorted(self.tmp.glob("*.log")):
            parts.append(f"--- {f.name}\n{f.read_text()[-3000:]}")
        return "\n".join(parts)

    def kill(self, p: subprocess.Popen, sig=signal.SIGKILL) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            p.wait(10)

    def kill_all(self) -> None:
        for p in self.procs:
            self.kill(p)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                self.kill(p, signal.SIGTERM)
        for pin in self.pin_dirs:  # normally removed by `ctl serve` on SIGTERM
            _run("rm", "-rf", pin, check=False)
        _run("rm", "-rf", str(self.tmp), check=False)
