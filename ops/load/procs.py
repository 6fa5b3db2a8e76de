"""Processes a fault scenario drives: `prism run` workers (start, SIGKILL, restart, peak RSS) and a
local broker that can be bounced on the same address with its data kept.

`ops/` cannot import `tests/`, so the worker spawner mirrors `tests/pipeline/kafkautil.spawn_worker`
(same command line, own process group, log to a file) and adds RSS sampling.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import structlog

from prism_pipeline.local_kafka import LocalKafka, LocalKafkaError, wait_for_metadata

log = structlog.get_logger(__name__)

REPO = Path(__file__).resolve().parents[2]
KAFKA_LIB = REPO / "ops" / "kafka" / "lib"


def _status_kib(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def rss_kib(pid: int | None) -> int | None:
    """A process's resident set now (VmRSS, KiB), None when it is gone."""
    return None if pid is None else _status_kib(pid, "VmRSS")


class WorkerProc:
    """One worker subprocess: `python -m <module> --log-json run ARGS` (module: the prism CLI, or
    `ops.load.slow_worker`), its log appended to `log_path`. Samples RSS while alive."""

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        *,
        module: str = "prism_pipeline.cli",
        env: dict[str, str] | None = None,
        name: str = "worker",
    ) -> None:
        self.args = args
        self.log_path = log_path
        self.module = module
        self.env = env or {}
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.peak_rss_kib = 0  # max VmHWM over every incarnation
        self.rss_samples: list[tuple[float, int]] = []  # (monotonic time, VmRSS KiB)
        self._sampler: threading.Thread | None = None

    def start(self) -> WorkerProc:
        if self.alive:
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")  # type: ignore[union-attr]
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        log_f = self.log_path.open("ab")
        cmd = [sys.executable, "-m", self.module, "--log-json", "run", *self.args]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True
        )
        log_f.close()
        self.starts += 1
        self._sampler = threading.Thread(target=self._sample, args=(self.proc,), daemon=True)
        self._sampler.start()
        log.info("load.worker_started", name=self.name, pid=self.proc.pid, start=self.starts)
        return self

    def _sample(self, proc: subprocess.Popen[bytes]) -> None:
        while proc.poll() is None:
            rss = _status_kib(proc.pid, "VmRSS")
            hwm = _status_kib(proc.pid, "VmHWM")
            if rss is not None:
                self.rss_samples.append((time.monotonic(), rss))
            if hwm is not None:
                self.peak_rss_kib = max(self.peak_rss_kib, hwm)
            time.sleep(0.25)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def signal(self, sig: int, timeout: float = 90.0) -> int | None:
        """Send `sig` and wait for the exit; returns the exit code (None if it was not running)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        if self._sampler is not None:
            self._sampler.join(timeout=2)
        log.info("load.worker_exited", name=self.name, signal=signal.Signals(sig).name, rc=rc)
        return rc

    def kill(self) -> int | None:
        return self.signal(signal.SIGKILL)

    def stop(self, timeout: float = 90.0) -> int | None:
        """Graceful stop (SIGTERM: drain, publish, commit); SIGKILL if it does not exit in time."""
        try:
            return self.signal(signal.SIGTERM, timeout)
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            return self.kill()

    def dump_stacks(self) -> None:
        """Ask a stuck worker for its threads' stacks (the CLI's SIGUSR1 handler) into its log."""
        if self.alive:
            self.proc.send_signal(signal.SIGUSR1)  # type: ignore[union-attr]
            time.sleep(1.0)

    def wait_log(self, text: str, timeout: float, after: int = 0) -> bool:
        """Wait until the log (from byte `after`) contains `text`, e.g. "partitions.assigned"."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if text in self.log_path.read_bytes()[after:].decode(errors="replace"):
                    return True
            except OSError:
                pass
            if not self.alive:
                return False
            time.sleep(0.25)
        return False

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class BounceableBroker:
    """A LocalKafka in a kept work dir that can be stopped and started again on the same port.

    `ops/kafka/kafka.sh start` picks fresh ports on every start, which clients holding the old
    address cannot follow; `bounce` therefore stops the broker with the script and relaunches the
    JVM on the server.properties the script wrote (same ports, same log dirs, same data), writing
    the pid file the script's `stop` reads.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir.resolve()
        self.kafka = LocalKafka(self.workdir)
        self.bootstrap = ""
        self.bounces = 0

    def start(self) -> str:
        self.bootstrap = self.kafka.start()
        return self.bootstrap

    def stop(self) -> None:
        self.kafka.stop()

    def bounce(self, down_s: float = 2.0, start_timeout: float = 90.0) -> float:
        """Stop (SIGTERM: controlled shutdown), stay down `down_s`, start again; returns outage seconds."""
        t0 = time.monotonic()
        self.kafka.stop()
        time.sleep(down_s)
        self._relaunch()
        wait_for_metadata(self.bootstrap, timeout=start_timeout)
        self.bounces += 1
        outage = time.monotonic() - t0
        log.info("load.broker_bounced", bootstrap=self.bootstrap, outage_s=round(outage, 2))
        return outage

    def _relaunch(self) -> None:
        d = self.workdir
        props = d / "server.properties"
        if not props.is_file():
            raise LocalKafkaError(f"no {props}: the broker was never started in {d}")
        jvm = "-XX:+UseSerialGC -XX:TieredStopAtLevel=1"  # the script's JVM options
        heap = os.environ.get("KAFKA_HEAP_OPTS", "-Xms128m -Xmx512m")
        cmd = [
            "java",
            *heap.split(),
            *jvm.split(),
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={d}/log4j2.properties",
            f"-Dkafka.logs.dir={d}/logs",
            "-cp",
            f"{KAFKA_LIB}/*",
            "kafka.Kafka",
            str(props),
        ]
        with (d / "logs" / "stdout.log").open("ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        (d / "pid").write_text(f"{proc.pid}\n")
        (d / "bootstrap").write_text(self.bootstrap + "\n")
        # As the script does: stop the broker if this process dies without stopping it. Its
        # `stop DIR` (LocalKafka.stop) ends the watchdog and the broker through these pid files.
        watchdog = subprocess.Popen(
            [
                "bash",
                "-c",
                'while kill -0 "$1" 2>/dev/null && kill -0 "$2" 2>/dev/null; do sleep 1; done;'
                ' kill -TERM "$2"',
                "_",
                str(os.getpid()),
                str(proc.pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        (d / "watchdog.pid").write_text(f"{watchdog.pid}\n")
