"""A pool of remote_accel servers placed, watched and restarted by Ray.

    import ray, remote_accel
    import remote_accel.ray
    ray.init()                                      # or ray.init(address="auto") on a cluster
    pool = remote_accel.ray.ServerPool(num_servers=2, resources_per_server={"num_gpus": 1})
    remote_accel.init(servers=pool)                 # remote_accel:0, remote_accel:1
    ...
    remote_accel.shutdown(); pool.shutdown()

Each server is a Ray actor whose process *is* a remote-accel-server (the same Server,
listeners and handshake, started in the actor): Ray puts it where the asked resources
are (a GPU: one server per GPU, CUDA_VISIBLE_DEVICES set by Ray; else `num_cpus`), and
restarts it when it dies (`max_restarts`). A restarted server is a new one: new port,
new token, no tensors. A client of the dead one gets RemoteAccelError for its tensors and
works again after `remote_accel.shutdown()` and `remote_accel.init(servers=pool)`.

Each server draws its own random token; it reaches the client as an actor method's
return value, through Ray's object store, never through a file.

Ray Train (`ray.train.torch.TorchTrainer`, docs/ray.md): its workers are the ranks of a
torch.distributed job; `TorchConfig(backend="raccl")` makes their process group raccl,
`WORKER_SETUP_HOOK` in the workers' runtime environment registers that backend before
Ray creates the group, and each worker's train loop calls `remote_accel.init(servers=pool)`
and trains on `remote_accel:<its world rank>`: one server of the pool per worker.

Importing this module does not import Ray; creating a pool does (`pip install
remote_accel[ray]`).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Optional

from .errors import ConfigError, RemoteAccelError, UnavailableError

log = logging.getLogger("remote_accel.ray")

__all__ = ["ServerPool", "WORKER_SETUP_HOOK", "setup_worker"]

#: Ray's `worker_process_setup_hook` for Ray Train's workers (the runtime environment of
#: `RunConfig(worker_runtime_env={"worker_process_setup_hook": WORKER_SETUP_HOOK})`):
#: setup_worker, named so that Ray imports it in the worker
WORKER_SETUP_HOOK = "remote_accel.ray.setup_worker"

#: How long the pool waits for its servers to start (or restart) when asked for them.
READY_TIMEOUT_S = 300.0
_RETRY_S = 0.5
#: resources_per_server keys that are ray.remote options; any other key is a custom resource.
_OPTION_KEYS = {"num_cpus": "num_cpus", "CPU": "num_cpus", "num_gpus": "num_gpus", "GPU": "num_gpus",
                "memory": "memory"}


def _ray():
    try:
        import ray
    except ImportError as exc:
        raise UnavailableError(f"remote_accel.ray needs Ray ({exc}): pip install 'remote_accel[ray]'") from None
    return ray


class _ServerActor:
    """One remote_accel server, in the actor's own process (Ray's worker)."""

    def __init__(self, device: str, host: str, options: list, num_threads: int):
        from .server import __main__ as cli
        from .server import heap, ops
        from .server.device import ComputeDevice, parse_device
        from .server.service import Server

        import torch

        if num_threads > 0:
            torch.set_num_threads(num_threads)
        heap.keep_freed_memory()  # the actor's process is the server's own
        if host.startswith(_HostChoice.PREFIX):
            host = _HostChoice.resolve(host)
        try:
            args = cli.build_parser().parse_args(["--listen", f"{host}:0", "--device", device, *options])
        except SystemExit:  # argparse said why on stderr (the actor's log)
            raise ConfigError(f"bad server options {options!r}: see remote-accel-server --help") from None
        why = cli.check_tls(args)
        if why is not None:
            raise ConfigError(why)
        ops.enable_namespaces(args.op_namespaces)
        self._token = secrets.token_hex(32)
        self._server = Server(ComputeDevice(parse_device(args.device)), self._token, memory_limit=args.memory_limit,
                              max_clients=args.max_clients, heartbeat_timeout=args.heartbeat_timeout)
        listeners = cli.open_listeners(args, [])
        for listener in listeners:
            self._server.serve(listener)
        port = listeners[0].address.rpartition(":")[2]  # "tcp:HOST:PORT"
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        logging.getLogger("remote_accel").info("remote_accel server %s on %s", self._address,
                                               self._server.device.name)

    def info(self) -> dict:
        """Where this server listens, its token, device and process."""
        return {"address": self._address, "token": self._token, "device": self._server.device.name,
                "pid": os.getpid()}

    def stats(self) -> dict:
        return self._server.stats()

    def stop(self) -> None:
        self._server.shutdown()


class ServerPool:
    """`num_servers` remote_accel servers as Ray actors; pass it to `remote_accel.init(servers=...)`.

    num_servers: how many servers (remote_accel:0 .. num_servers-1 for a client).
    resources_per_server: the Ray resources each server holds, e.g. {"num_gpus": 1} (one
      server per GPU: it runs on device "cuda", the GPU Ray gave it) or {"num_cpus": 2}
      (a CPU server); keys num_cpus/CPU, num_gpus/GPU, memory, and custom resources.
      Default: one GPU where the cluster has GPUs, else one CPU.
    device: the torch device the servers run on; default "cuda" with num_gpus, else "cpu".
    host: the address clients (and the other servers, for direct copies) reach a server
      at; default: 127.0.0.1 for a server on the driver's machine, else its node's IP,
      which carries tensors in clear and so needs `insecure=True` (a network you trust).
    insecure: allow plain TCP on a non-loopback address (remote-accel-server --insecure).
    server_options: more remote-accel-server options, e.g. ["--memory-limit", "8G"].
    max_restarts: how often Ray restarts a server that died (-1: always).
    ready_timeout: seconds to wait for the servers to start (or restart) when asked.

    Ray must be initialised (`ray.init(...)`) first. The pool owns its actors: shutdown()
    (or leaving a `with` block) ends them.
    """

    def __init__(self, num_servers: int = 2, resources_per_server: Optional[dict] = None, *,
                 device: Optional[str] = None, host: Optional[str] = None, insecure: bool = False,
                 server_options: Optional[list] = None, max_restarts: int = -1,
                 ready_timeout: float = READY_TIMEOUT_S):
        ray = _ray()
        if type(num_servers) is not int or num_servers < 1:
            raise ConfigError(f"num_servers must be a positive int, not {num_servers!r}")
        if not ray.is_initialized():
            raise RemoteAccelError("ServerPool needs Ray: call ray.init() (or ray.init(address=...)) first")
        options = self._ray_options(ray, resources_per_server)
        if device is None:
            device = "cuda" if options.get("num_gpus") else "cpu"
        threads = int(options.get("num_cpus") or 0)
        extra = list(server_options or [])
        if insecure:
            extra.append("--insecure")
        self.ready_timeout = ready_timeout
        self._driver_ip = ray.util.get_node_ip_address()
        remote = ray.remote(_ServerActor).options(
            max_restarts=max_restarts, max_task_retries=0,
            **options)
        self._host = host
        self._actors = [remote.remote(device, host or _HostChoice.token(self._driver_ip), extra, threads)
                        for _ in range(num_servers)]
        try:
            self.info()  # wait for them: a server that cannot start says why here
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def _ray_options(ray, resources: Optional[dict]) -> dict:
        if resources is None:
            gpus = ray.cluster_resources().get("GPU", 0)
            resources = {"num_gpus": 1} if gpus else {"num_cpus": 1}
        options: dict = {}
        custom = {}
        for key, value in dict(resources).items():
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"resources_per_server[{key!r}] must be a number >= 0, not {value!r}")
            if key in _OPTION_KEYS:
                options[_OPTION_KEYS[key]] = value
            else:
                custom[key] = value
        options.setdefault("num_cpus", 1)
        if custom:
            options["resources"] = custom
        return options

    # -- what clients need --------------------------------------------------------------------
    @property
    def actors(self) -> list:
        """The servers' Ray actor handles, in device order (ray.kill one to test a restart)."""
        return list(self._actors)

    def __len__(self) -> int:
        return len(self._actors)

    def info(self) -> list[dict]:
        """Per server: address, token, device, pid. Waits (up to ready_timeout) for servers
        that are starting or being restarted by Ray."""
        ray = _ray()
        deadline = time.monotonic() + self.ready_timeout
        out = []
        for index, actor in enumerate(self._actors):
            while True:
                try:
                    out.append(ray.get(actor.info.remote(), timeout=max(1.0, deadline - time.monotonic())))
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                    if time.monotonic() >= deadline or _dead_for_good(exc):
                        raise RemoteAccelError(f"remote_accel server {index} of the pool is not available: "
                                               f"{exc}") from None
                    time.sleep(_RETRY_S)  # Ray is restarting it
        return out

    def addresses(self) -> list[str]:
        """The servers' "host:port" TCP addresses, remote_accel:0 first."""
        return [i["address"] for i in self.info()]

    def tokens(self) -> list[str]:
        """Each server's token, in the order of addresses() (they travel through Ray)."""
        return [i["token"] for i in self.info()]

    def stats(self) -> list[dict]:
        """Each server's server-wide figures (sessions, memory, peer copies), through Ray."""
        ray = _ray()
        return ray.get([a.stats.remote() for a in self._actors])

    def shutdown(self) -> None:
        """End every server (their clients' tensors are lost); the pool is unusable afterwards."""
        if not self._actors:
            return
        ray = _ray()
        actors, self._actors = self._actors, []
        for actor in actors:
            try:
                ray.get(actor.stop.remote(), timeout=10)
            except Exception as exc:  # already dead, or stuck: killed below either way
                log.debug("stopping a server of the pool: %s", exc)
            ray.kill(actor, no_restart=True)

    def __enter__(self) -> "ServerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"ServerPool({len(self._actors)} servers)"


class _HostChoice:
    """host=None: loopback on the driver's own node, else the node's address. Decided in
    the actor, which knows its node: the choice travels as a marker string."""

    PREFIX = "auto-for-driver-"

    @classmethod
    def token(cls, driver_ip: str) -> str:
        return cls.PREFIX + driver_ip

    @classmethod
    def resolve(cls, marker: str) -> str:
        import ray

        here = ray.util.get_node_ip_address()
        return "127.0.0.1" if here == marker[len(cls.PREFIX):] else here


def setup_worker() -> None:
    """Make this Ray worker process a remote_accel client: the device and its
    torch.distributed backend `raccl` registered with torch, connecting to nothing yet.
    Ray Train creates its workers' process group (`TorchConfig(backend="raccl")`) before
    the train loop runs, and torch knows a backend only once it is registered; the loop's
    `remote_accel.init(servers=pool)` then connects, and the group's first collective
    joins the servers. Ray runs this in each worker as it starts (WORKER_SETUP_HOOK)."""
    from .pytorch_ext import _register

    _register.register_device()


def _dead_for_good(exc) -> bool:
    """An actor Ray will not restart (max_restarts used up, or killed with no_restart)."""
    text = str(exc)
    return any(why in text for why in ("will not be restarted", "no_restart=True", "max_restarts",
                                       "creation task", "ConfigError"))
