"""An elastic ``spark-hvd-run`` job: the rendezvous store with the elastic hooks, the driver,
processes as workers, and a discovery thread (``launch/elastic`` holds the logic).

The store listens on 127.0.0.1 when every host is this machine (the tests' ``localhost``,
``127.0.0.2``, ...), else on every interface (or the pinned one); each worker reaches it, and
advertises its own listener, on the route to the job's first remote host, as static jobs do.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import threading

from spark_hvd.common import _bootstrap_contract as contract
from spark_hvd.common._rendezvous import RendezvousServer
from spark_hvd.common._secret import make_secret, secret_to_env
from spark_hvd.launch import net as _net
from spark_hvd.launch.elastic.driver import ElasticDriver, StoreChannel, worker_event
from spark_hvd.launch.elastic.hosts import FixedHosts, HostManager
from spark_hvd.launch.elastic.policy import FailurePolicy
from spark_hvd.launch.elastic.spawner import ProcessSpawner, elastic_env
from spark_hvd.launch.output import LineSink
from spark_hvd.runner import _env

PROG = "spark-hvd-run"
DEFAULT_PEER_TIMEOUT_SECONDS = 25.0


class ElasticJob:
    """One elastic launch; :meth:`run` returns the driver's :class:`Outcome`."""

    def __init__(self, args, command, discovery, *, num_proc, min_np, max_np, elastic_timeout,
                 reset_limit, cooldown_range, start_timeout, interface_ip, log, discover_every,
                 on_user_error="raise", base_env=None, cwd=None):
        self.args = args
        self.command = command
        self.discovery = discovery
        self.num_proc, self.min_np, self.max_np = num_proc, min_np, max_np
        self.elastic_timeout = elastic_timeout
        self.reset_limit = reset_limit
        self.cooldown_range = cooldown_range
        self.start_timeout = start_timeout
        self.interface_ip = interface_ip
        self.log = log
        # Horovod's tests ask for 10 ms; a discovery script is a process: 0.1 s at least.
        self.discover_every = max(0.1, float(discover_every))
        self.on_user_error = on_user_error
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.cwd = cwd or os.getcwd()
        self.out = LineSink(sys.stdout)
        self.err = LineSink(sys.stderr)
        self._local: dict[str, bool] = {}

    def is_local(self, host):
        if host not in self._local:
            self._local[host] = _net.is_local_host(host)
        return self._local[host]

    def run(self):
        try:
            first = self.discovery.find_available_hosts_and_slots()
        except Exception as e:  # noqa: BLE001 - the first call decides, as in Horovod
            raise RuntimeError(f"host discovery failed: {e}") from None
        known = list(first)
        all_local = all(self.is_local(h) for h in known) and isinstance(self.discovery,
                                                                        FixedHosts)
        bind_host = self.interface_ip or ("127.0.0.1" if all_local else "0.0.0.0")
        secret, job_id = make_secret(), secrets.token_hex(4)
        scope = contract.elastic_scope(job_id)
        peer_timeout = float(contract.setting("PEER_TIMEOUT_SECONDS", self.base_env)
                             or DEFAULT_PEER_TIMEOUT_SECONDS)
        driver_box = {}

        def on_put(put_scope, key, value):
            event = worker_event(key, value) if put_scope == scope else None
            if event is not None:
                driver_box["d"].post(event)

        server = RendezvousServer(
            secret, bind_host=bind_host, on_put=on_put,
            on_hello=lambda wid: driver_box["d"].post(("hello", wid)),
            on_disconnect=lambda wid, how: driver_box["d"].post(("disconnected", wid, how)),
            peer_timeout=peer_timeout)
        port = server.start()
        config = _env.config_env(self.args)
        secret_hex = secret_to_env(secret)
        hosts = HostManager(self.discovery, cooldown_range=self.cooldown_range)
        policy = FailurePolicy(on_user_error=self.on_user_error, reset_limit=self.reset_limit,
                               min_np=self.min_np, elastic_timeout=self.elastic_timeout)

        def address_for(host):
            if self.interface_ip:
                return self.interface_ip
            if bind_host == "127.0.0.1":
                return "127.0.0.1"
            remote = [h for h in hosts.current_hosts.host_assignment_order
                      if not self.is_local(h)]
            if self.is_local(host):
                return _net.route_address(remote[0]) if remote else "127.0.0.1"
            return _net.route_address(host)

        def env_for(spec):
            everyone_local = all(self.is_local(h) for h in hosts.current_hosts.
                                 host_assignment_order)
            addr = address_for(spec.host)
            return elastic_env(
                self.base_env, spec, rendezvous_addr=f"[{addr}]:{port}" if ":" in addr
                else f"{addr}:{port}", secret_hex=secret_hex, job_id=job_id,
                bind_addr=_env.bind_address(spec.host, everyone_local),
                start_timeout=self.start_timeout, elastic_timeout=self.elastic_timeout,
                config=config)

        def rank_of(wid):
            d = driver_box["d"]
            w = d.workers.get(wid)
            if w is None:
                return "?"
            return w.rank if w.rank is not None else w.spec.planned.rank

        grace = float(os.environ.get("SPARK_HVD_KILL_GRACE_SECONDS", 5.0))
        spawner = ProcessSpawner(
            self.command, env_for, lambda ev: driver_box["d"].post(ev), self.is_local, rank_of,
            self.out, self.err, cwd=self.cwd, output_dir=self.args.output_filename,
            timestamp=self.args.prefix_timestamp, ssh_port=self.args.ssh_port,
            ssh_identity_file=self.args.ssh_identity_file, connect_timeout=self.start_timeout,
            grace_seconds=grace)
        driver = ElasticDriver(hosts, spawner, StoreChannel(server, scope),
                               num_proc=self.num_proc, min_np=self.min_np, max_np=self.max_np,
                               policy=policy, elastic_timeout=self.elastic_timeout,
                               start_timeout=self.start_timeout,
                               rejoin_timeout=contract.elastic_rejoin_timeout(self.base_env),
                               log=self.log)
        driver_box["d"] = driver
        self.log(f"elastic job {job_id}: {self.num_proc} process(es) to start, min "
                 f"{self.min_np}, max {self.max_np or 'all slots'}; rendezvous on {bind_host} "
                 f"port {port}; elastic timeout {self.elastic_timeout:g} s", "INFO")
        stop = threading.Event()
        driver.post(("discovered", first))
        discovery_thread = threading.Thread(target=self._discover, args=(driver, stop),
                                            name="spark-hvd-discovery", daemon=True)
        discovery_thread.start()
        restore = self._install_signal_handlers(driver)
        try:
            outcome = driver.run(wind_down=grace + 5.0)
        finally:
            restore()
            stop.set()
            spawner.drain_output()
            spawner.stop_leftovers()
            server.stop()
            discovery_thread.join(timeout=15)
        return outcome

    def _discover(self, driver, stop):
        while not stop.wait(self.discover_every):
            try:
                hosts = self.discovery.find_available_hosts_and_slots()
            except Exception as e:  # noqa: BLE001 - the driver decides
                driver.post(("discovery_failed", str(e)))
                continue
            driver.post(("discovered", hosts))

    def _install_signal_handlers(self, driver):
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        old = {s: signal.signal(s, lambda signum, frame: driver.post(("signal", signum)))
               for s in sigs}

        def restore():
            for s, handler in old.items():
                signal.signal(s, handler)
        return restore

