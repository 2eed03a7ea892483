"""Starting ranks: directly on this machine, or through ssh on another one.

Every rank runs in its own session (process group) so that tearing the job down kills whatever
the rank started too, not just the rank. The job secret never appears on a command line (where
``ps`` would show it to every user of the machine): local ranks get it in their environment,
remote ranks read it from ssh's stdin.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading

from spark_hvd.common._bootstrap_contract import SECRET

# Variables of the launcher's environment that describe the launcher's own machine or shell
# session and must not be copied to another host.
_NOT_FORWARDED = {"HOME", "USER", "LOGNAME", "SHELL", "MAIL", "PWD", "OLDPWD", "HOSTNAME",
                  "SHLVL", "_", "TERM", "DISPLAY", "XAUTHORITY", "TMPDIR"}
_NOT_FORWARDED_PREFIXES = ("SSH_", "BASH_FUNC_", "XDG_", "OMPI_COMM_WORLD_")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def forwardable_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` to send to a remote rank: everything except the secret (sent on
    stdin), per-machine/session variables, and names or values a shell line cannot carry."""
    return {k: v for k, v in env.items()
            if k != SECRET and k not in _NOT_FORWARDED
            and not k.startswith(_NOT_FORWARDED_PREFIXES)
            and _ENV_NAME.match(k) and "\n" not in v and "\0" not in v}


def remote_script(command: list[str], env: dict[str, str], cwd: str) -> str:
    """The POSIX sh script a remote host runs for one rank.

    It reads the secret from the first line of stdin, starts the command in a new session, and
    keeps watching stdin: when ssh's stdin closes (the launcher tore the job down, died, or the
    connection dropped) it kills the rank's whole process group, SIGTERM then SIGKILL, because
    without a terminal nothing else tells remote processes that their launcher is gone. When the
    rank exits by itself, processes it left in its group are stopped too.
    """
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    cmd = " ".join(shlex.quote(c) for c in command)
    return "\n".join([
        f"cd {shlex.quote(cwd)} 2>/dev/null || {{ echo \"spark-hvd-run: $(hostname) has no "
        f"directory\" {shlex.quote(cwd)} >&2; exit 127; }}",
        f"IFS= read -r {SECRET} || exit 1",
        f"export {SECRET}",
        "exec 3<&0",
        # setsid makes the rank a group leader so `kill -SIG -PGID` reaches all it started.
        'sess=; command -v setsid >/dev/null 2>&1 && sess=setsid',
        f"$sess env {assignments} {cmd} </dev/null 3<&- &",
        "child=$!",
        "( cat <&3 >/dev/null 2>&1; kill -TERM -$child $child 2>/dev/null; sleep 5;"
        " kill -KILL -$child $child 2>/dev/null ) >/dev/null 2>&1 &",
        "watcher=$!",
        "exec 3<&-",
        "wait $child; rc=$?",
        "kill $watcher 2>/dev/null",
        # Whatever the rank started and left behind goes with it (as for local ranks).
        # Not waiting for them here keeps the rank's exit code prompt to reach the launcher.
        "if kill -0 -$child 2>/dev/null; then",
        "  kill -TERM -$child 2>/dev/null",
        "  ( sleep 5; kill -KILL -$child 2>/dev/null ) </dev/null >/dev/null 2>&1 &",
        "fi",
        "exit $rc",
    ])


def ssh_command(host: str, command: list[str], env: dict[str, str], cwd: str,
                port: int | None = None, identity_file: str | None = None,
                connect_timeout: float | None = None) -> list[str]:
    """argv of the local ``ssh`` process that runs one rank on ``host``.

    ``env`` is the rank's full environment; only :func:`forwardable_env` of it is put on the
    remote command line. Write the secret, then a newline, to the process's stdin.
    """
    # LogLevel=ERROR drops ssh's "Warning: Permanently added ... to the list of known hosts"
    # (an INFO message) from every rank's stderr on a first contact; connection, host key and
    # authentication failures are errors and still show.
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o",
            "LogLevel=ERROR"]
    if connect_timeout:
        argv += ["-o", f"ConnectTimeout={max(1, int(connect_timeout))}"]
    if port:
        argv += ["-p", str(port)]
    if identity_file:
        argv += ["-i", identity_file]
    script = remote_script(command, forwardable_env(env), cwd)
    # The remote login shell may not be sh (csh, fish): hand the script to sh explicitly.
    argv += [host, "sh -c " + shlex.quote(script)]
    return argv


def _set_parent_death_signal() -> None:
    """In the child, before exec: get SIGTERM if the launcher dies (Linux), so that a launcher
    killed with SIGKILL does not leave its ranks running forever."""
    import ctypes
    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class RankProcess:
    """One rank's local process (the rank itself, or the ssh client running it)."""

    def __init__(self, rank: int, host: str, popen: subprocess.Popen, remote: bool):
        self.rank = rank
        self.host = host
        self.popen = popen
        self.remote = remote
        # start_new_session=True makes the child the leader of a new group with its pid.
        self.pgid = popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the rank's process group (ignoring a group that is already gone)."""
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def group_alive(self) -> bool:
        """True while any process of the rank's group is still alive."""
        try:
            os.killpg(self.pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def close_stdin(self) -> None:
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass


def spawn(rank: int, host: str, command: list[str], env: dict[str, str], cwd: str,
          remote: bool, ssh_port: int | None = None, ssh_identity_file: str | None = None,
          connect_timeout: float | None = None) -> RankProcess:
    """Start one rank with its stdout/stderr on pipes; the caller reads them."""
    use_pdeathsig = (sys.platform.startswith("linux")
                     and threading.current_thread() is threading.main_thread())
    common = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                  preexec_fn=_set_parent_death_signal if use_pdeathsig else None)
    if not remote:
        popen = subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, **common)
        return RankProcess(rank, host, popen, remote=False)
    argv = ssh_command(host, command, env, cwd, port=ssh_port, identity_file=ssh_identity_file,
                       connect_timeout=connect_timeout)
    popen = subprocess.Popen(argv, stdin=subprocess.PIPE, **common)
    # Keep stdin open after the secret: its closing is the remote side's signal to stop.
    try:
        popen.stdin.write(env[SECRET].encode() + b"\n")
        popen.stdin.flush()
    except BrokenPipeError:
        pass  # ssh already failed; its exit code and stderr tell the user why
    return RankProcess(rank, host, popen, remote=True)
