"""Ray's real autoscaler on one machine, without touching anyone else's Ray.

``ray.cluster_utils.AutoscalingCluster`` starts a head whose autoscaler launches "nodes" as
local processes (the fake multi-node provider). As shipped it cannot run here: its
constructor reads a ``fake_multi_node/example.yaml`` the wheel lacks, and ``start()`` and
``shutdown()`` run ``ray stop --force``, which kills every Ray process on the machine.
``OwnAutoscalingCluster`` keeps its config generation but reads kvmesh's own YAML
(``data/fake_multi_node.yaml``), starts the head itself on free ports in a temp dir of its
own, and stops exactly the processes of that cluster: every process whose command line
names its temp dir. The fake nodes the autoscaler launches inherit the head's temp dir
(``ray._private.node.Node`` uses the head's when it is given none), so they are found the
same way.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml
from helpers import free_port, ray_side_port_flags
from ray.cluster_utils import AutoscalingCluster

CONFIG = Path(__file__).parent / "data" / "fake_multi_node.yaml"


class OwnAutoscalingCluster(AutoscalingCluster):
    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **kw):
        if autoscaler_v2:
            raise ValueError("only the v1 autoscaler is set up here")
        cfg = yaml.safe_load(CONFIG.read_text())
        cfg["available_node_types"] = dict(worker_node_types)
        cfg["available_node_types"]["ray.head.default"] = {
            "resources": dict(head_resources),
            "node_config": {},
            "max_workers": 0,
        }
        cfg.update(kw)
        return cfg

    def start(self, _system_config=None, override_env=None) -> str:
        """Start the head (its autoscaler included); returns the GCS address to
        ``ray.init``."""
        import ray

        # short: Ray's Unix socket paths live under it (at most 107 bytes)
        self.temp_dir = tempfile.mkdtemp(prefix="kvr", dir="/tmp")
        self.port = free_port()
        ip = ray.util.get_node_ip_address()
        self.address = f"{ip}:{self.port}"
        self._config["provider"]["gcs_address"] = self.address
        cfg_path = Path(self.temp_dir) / "autoscaling.json"
        cfg_path.write_text(json.dumps(self._config))
        res = dict(self._head_resources)
        cmd = [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            f"--autoscaling-config={cfg_path}",
            f"--port={self.port}",
            f"--temp-dir={self.temp_dir}",
            f"--num-cpus={res.pop('CPU', 0)}",
            f"--num-gpus={res.pop('GPU', 0)}",
            f"--object-store-memory={res.pop('object_store_memory', 100 * 2**20)}",
            *ray_side_port_flags(),
        ]
        if res:
            cmd.append(f"--resources={json.dumps(res)}")
        env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1"}
        # Ray's token auth: the head, the nodes its autoscaler launches (they inherit this
        # environment) and this driver must agree; loopback-only test cluster, no token
        env["RAY_AUTH_MODE"] = "disabled"
        self._old_auth_mode = os.environ.get("RAY_AUTH_MODE")
        os.environ["RAY_AUTH_MODE"] = "disabled"  # for this driver; restored by shutdown
        env.update(override_env or {})
        env.pop("RAY_ADDRESS", None)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
        if out.returncode != 0:
            self.shutdown()
            raise RuntimeError(f"ray start failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        ray._private.services.find_gcs_addresses.cache_clear()
        return self.address

    def processes(self) -> list[psutil.Process]:
        """This cluster's processes: the head's and every fake node's."""
        mine = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if p.pid != os.getpid() and any(
                    self.temp_dir in a for a in p.info["cmdline"] or ()
                ):
                    mine.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return mine

    def shutdown(self) -> None:
        """Stop this cluster's processes only (SIGTERM, then SIGKILL after 1 s: the GCS does
        not stop on SIGTERM within 10 s, and nothing of a test cluster needs keeping)."""
        old = getattr(self, "_old_auth_mode", None)
        if old is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = old
        if not hasattr(self, "temp_dir"):
            return  # never started
        procs = self.processes()
        for p in procs:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=1)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
        # processes started after the first sweep (a worker spawning): once more, and
        # waited for, so that no killed process still shows its command line to the caller
        late = self.processes()
        for p in late:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(late, timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n["Alive"]]


def wait_for_nodes(n: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(alive_nodes()) == n:
            return True
        time.sleep(0.5)
    return False
