"""A real two-node SLURM cluster on this one machine, for the tests of slurm/ (Debian's SLURM 22.05 packages).

One slurmctld and two slurmd (`slurmd -N n1`, `-N n2`, each on its own port, NodeAddr=127.0.0.1) run from a
private folder with their own slurm.conf (found through SLURM_CONF, so /etc/slurm is not touched); munge is
started if it is not running. The node names are added to /etc/hosts, which is rewritten in place (it may be a
bind mount, so never replaced by a rename) and restored at the end. :meth:`SlurmCluster.stop` cancels every
job, waits for the queue to drain, stops each daemon by its pid file, waits for it to exit and removes the
folder. A session that died before cleaning up is cleaned up by the next :meth:`SlurmCluster.start`.

Requeue settings are short (credentials expire after 5 s, the scheduler runs every 2 s), so a requeued job
restarts about 7 s after `scontrol requeue` here rather than after SLURM's default of about two minutes.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from lmrecipe.train.callbacks.preemption import process_alive

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
COMMANDS = ("slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "munged")
NODES = ("n1", "n2")
CPUS_PER_NODE = 2
HOSTS = Path("/etc/hosts")
HOSTS_MARK = "# lmrecipe test cluster"
MUNGE_PID = Path("/run/munge/munged.pid")


class ClusterUnavailable(RuntimeError):
    """SLURM cannot run here; the message says why."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]



def _stop_pid_file(pid_file: Path, timeout_s: float = 30.0) -> None:
    """SIGTERM the process named in ``pid_file``, wait for it to exit (SIGKILL after ``timeout_s``)."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return
    if not process_alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if process_alive(pid):
        os.kill(pid, signal.SIGKILL)
        while process_alive(pid):
            time.sleep(0.1)


def ensure_installed(install: bool = True) -> None:
    """Install the Debian packages with apt-get if a command is missing; raise ClusterUnavailable if impossible."""
    missing = [c for c in COMMANDS if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"SLURM is not installed ({', '.join(missing)} missing) and installing it needs root")
    if not install or shutil.which("apt-get") is None:
        raise ClusterUnavailable(f"SLURM is not installed ({', '.join(missing)} missing) and apt-get is not available")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise ClusterUnavailable(f"`{' '.join(cmd)}` failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-1500:]}")


class SlurmCluster:
    """Two SLURM nodes on this machine. ``env`` is the environment for sbatch/squeue/... against this cluster."""

    def __init__(self, root: Path = Path("/tmp/lmrecipe-slurm-cluster")):
        self.root = root
        self.conf = root / "slurm.conf"
        self.hosts_backup = root / "hosts.orig"
        self.jobcomp = root / "jobcomp.txt"
        self.started_munge = False
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ----------------------------------------------------------------------------------------------
    # Bring-up

    def start(self, timeout_s: float = 60.0) -> None:
        if os.geteuid() != 0:
            raise ClusterUnavailable("starting SLURM daemons needs root")
        ensure_installed()
        self._cleanup_leftovers()
        (self.root / "state").mkdir(parents=True)
        for node in NODES:
            (self.root / "spool" / node).mkdir(parents=True)
        try:
            self._write_conf()
            self._add_hosts()
            self._start_munge()
            self._spawn("slurmctld", "-D", "-i")
            for node in NODES:
                self._spawn("slurmd", "-D", "-N", node)
            self._wait_idle(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        r = self.root
        lines = [
            "ClusterName=lmrecipe-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # Credentials expire after 5 s instead of 120 s: a requeued job may restart that much sooner.
            "AuthInfo=cred_expire=5",
            "SchedulerParameters=sched_interval=2,bf_interval=2",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No systemd and no cgroups here: track processes through /proc, bind nothing.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            # Finished and requeued jobs are listed here (there is no sacct without accounting).
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.jobcomp}",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "JobRequeue=1",
            "KillWait=10",
            "InactiveLimit=0",
        ]
        for node in NODES:
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} "
                         f"CPUs={CPUS_PER_NODE} RealMemory=1000 State=UNKNOWN")
        lines.append(f"PartitionName=test Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _add_hosts(self) -> None:
        """Node names must resolve for slurmd and srun: add them; rewrite in place, never by a rename."""
        original = HOSTS.read_text()
        self.hosts_backup.write_text(original)
        HOSTS.write_text(original.rstrip("\n") + f"\n127.0.0.1 {' '.join(NODES)} {HOSTS_MARK}\n")

    def _start_munge(self) -> None:
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            run_dir = MUNGE_PID.parent
            run_dir.mkdir(parents=True, exist_ok=True)
            shutil.chown(run_dir, "munge", "munge")
            if not Path("/etc/munge/munge.key").exists():
                subprocess.run(["mungekey", "--create"], check=True, capture_output=True)
                shutil.chown("/etc/munge/munge.key", "munge", "munge")
            subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True, capture_output=True)
            self.started_munge = True
        check = subprocess.run("munge -n | unmunge", shell=True, capture_output=True, text=True)
        if check.returncode != 0:
            raise ClusterUnavailable(f"munge does not work: {check.stderr.strip()}")

    def _spawn(self, *cmd: str) -> None:
        # setsid -f: the daemon leaves this process's session and output, so it neither holds a CI step's
        # output open nor receives the signals meant for the test run.
        subprocess.run(["setsid", "-f", *cmd], env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=True)

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states = ""
        while time.monotonic() < deadline:
            proc = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = proc.stdout.strip()
            if proc.returncode == 0 and sorted(states.splitlines()) == [f"{n} idle" for n in NODES]:
                return
            time.sleep(0.3)
        raise ClusterUnavailable(f"the SLURM nodes did not become idle within {timeout_s:.0f} s (sinfo: {states!r}); "
                                 f"logs in {self.root}:\n{self.logs()}")

    # ----------------------------------------------------------------------------------------------
    # Use

    def run(self, cmd: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("timeout", 60)
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, **kwargs)
        if check and proc.returncode != 0:
            raise AssertionError(f"{cmd} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc

    def job_state(self, job_id: str) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, ...) from slurmctld, "" once it is forgotten."""
        proc = self.run(["scontrol", "-o", "show", "job", job_id], check=False)
        for field in proc.stdout.split():
            if field.startswith("JobState="):
                return field.removeprefix("JobState=")
        return ""

    def completions(self) -> list[dict[str, str]]:
        """One dict per finished or requeued job run (jobcomp/filetxt), oldest first."""
        if not self.jobcomp.exists():
            return []
        return [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in self.jobcomp.read_text().splitlines()]

    def logs(self, tail_chars: int = 3000) -> str:
        out = []
        for log in sorted(self.root.glob("*.log")):
            out.append(f"--- {log.name}\n{log.read_text(errors='replace')[-tail_chars:]}")
        return "\n".join(out)

    # ----------------------------------------------------------------------------------------------
    # Teardown

    def stop(self) -> None:
        """Cancel every job, stop the daemons this cluster started, remove its folder, restore /etc/hosts."""
        if (self.root / "slurmctld.pid").exists() and self.conf.exists():
            self.run(["scancel", "--user", "root"], check=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                queue = self.run(["squeue", "-h", "-o", "%i"], check=False)
                if queue.returncode != 0 or not queue.stdout.strip():
                    break
                time.sleep(0.5)
        for node in NODES:
            _stop_pid_file(self.root / f"slurmd-{node}.pid")
        _stop_pid_file(self.root / "slurmctld.pid")
        if self.started_munge:
            _stop_pid_file(MUNGE_PID)
            self.started_munge = False
        self._restore_hosts()
        shutil.rmtree(self.root, ignore_errors=True)

    def _restore_hosts(self) -> None:
        if self.hosts_backup.exists():
            HOSTS.write_text(self.hosts_backup.read_text())
            self.hosts_backup.unlink()
        elif HOSTS_MARK in HOSTS.read_text():
            HOSTS.write_text("".join(line for line in HOSTS.read_text().splitlines(True) if HOSTS_MARK not in line))

    def _cleanup_leftovers(self) -> None:
        """Stop what a session that crashed before its teardown left behind (same folder)."""
        if self.root.exists() or HOSTS_MARK in HOSTS.read_text():
            self.stop()
