"""Running ``spark-hvd-run`` against the bed's hosts, and reading what its ranks report.

Shared by the launcher and interface tests. The launcher is the installed entry point
(``.venv/bin/spark-hvd-run``, next to the interpreter running the tests), started in the root
namespace (the "login node") or, with ``host=``, inside one of the bed's hosts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable
LAUNCHER = str(Path(PY).with_name("spark-hvd-run"))
RANK_REPORT = str(Path(__file__).resolve().with_name("rank_report.py"))
_REPORT = re.compile(r"^\[(\d+)\]<stdout>: REPORT (\{.*\})$")


@dataclass
class Launch:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def reports(self) -> dict[int, dict]:
        """The ranks' REPORT lines by the rank in the launcher's prefix (which must match the
        rank the report itself names)."""
        out = {}
        for line in self.stdout.splitlines():
            m = _REPORT.match(line)
            if m:
                report = json.loads(m.group(2))
                assert report["rank"] == int(m.group(1)), line
                out[report["rank"]] = report
        return out


def launch(args: list[str], bed=None, host=None, env: dict[str, str] | None = None,
           timeout: float = 90) -> Launch:
    """Runs ``spark-hvd-run ARGS python rank_report.py ...`` (``args`` ends with the rank's
    own arguments after ``--``, if any) and waits for it; ``host``: inside that bed host."""
    argv = [LAUNCHER, *args]
    full_env = dict(os.environ, **(env or {}))
    t = time.monotonic()
    if host is not None:
        done = bed.run(host, argv, timeout=timeout, env=full_env)
    else:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env=full_env)
    return Launch(done.returncode, done.stdout, done.stderr, time.monotonic() - t)


def rank_command(*rank_args: str) -> list[str]:
    return ["--", PY, RANK_REPORT, *rank_args]


def host_list(hosts, slots: int, attr: str = "addr") -> str:
    """``-H`` for ``slots`` ranks on each host, naming hosts by ``attr`` (addr, mgmt_addr,
    hostname)."""
    return ",".join(f"{getattr(h, attr)}:{slots}" for h in hosts)


def wait_until_only(bed, baseline: dict, seconds: float = 15) -> dict:
    """Waits until each host runs only the processes of ``baseline`` (host name -> pids, e.g.
    its sshd); returns what else still runs per host when ``seconds`` have passed (empty: none).
    """
    deadline = time.monotonic() + seconds
    while True:
        extra = {h.name: sorted(set(bed.pids(h)) - baseline[h.name]) for h in bed.hosts}
        extra = {name: pids for name, pids in extra.items() if pids}
        if not extra or time.monotonic() > deadline:
            return {name: [_describe(pid) for pid in pids] for name, pids in extra.items()}
        time.sleep(0.2)


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read().replace(b"\0", b" ").decode(errors="replace")
        return f"{pid} {command[:200]}"
    except OSError:
        return str(pid)


def start_mgmt_sshd(bed, access) -> None:
    """Runs a second sshd in every host on its management address (``start_sshd``'s listen
    only on the bridge address), from the same configuration, so a launcher can reach the
    hosts through their management links."""
    for h in bed.hosts:
        base = Path(access.directory, f"sshd_config.{h.netns}").read_text()
        config = Path(access.directory, f"sshd_config_mgmt.{h.netns}")
        config.write_text(base.replace(f"ListenAddress {h.addr}", f"ListenAddress {h.mgmt_addr}")
                          .replace(f"sshd.{h.netns}.pid", f"sshd_mgmt.{h.netns}.pid"))
        bed.popen(h, ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for h in bed.hosts:
        deadline = time.monotonic() + 20
        while subprocess.run(access.ssh_argv(h.mgmt_addr, "true"), capture_output=True,
                             timeout=30).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {h.name}'s management address did not come up")
            time.sleep(0.2)
