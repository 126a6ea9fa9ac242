"""Start a real ``tritonserver`` on a model repository: ``nightdraft serve``.

Where the server comes from, in order:

1. an explicit ``--tritonserver PATH`` (or ``$NIGHTDRAFT_TRITONSERVER``);
2. ``tritonserver`` on ``PATH`` (NGC images; their backends live in the server's default
   backend directory, so we pass none);
3. the server shipped in the ``nvidia-pytriton`` wheel. That wheel carries the Python backend
   (``libtriton_python.so``) and one ``triton_python_backend_stub`` per Python version in a
   separate folder, so we lay out a backend directory (a cache, built once per wheel, Python
   version and nightdraft backend) with the library and the stub for the running interpreter
   next to it, and the nightdraft backend.

nightdraft is a Python-based backend (``backends/nightdraft/model.py``, see
``client.backend_dir``): a server whose own backend directory lacks the current copy runs with a
backend directory of ours that adds it to its backends.

The server runs with this environment's ``bin`` first on ``PATH`` (the Python backend stub uses
the first ``python3`` on ``PATH``, so models import this environment's packages), the wheel's
shared libraries on ``LD_LIBRARY_PATH``, and ``$NIGHTDRAFT_ROOT`` naming the directory that
holds the ``backend`` package (the backend's model.py imports it from there when the package
is not installed, and checkpoint paths in an engine.json may name it).

Security defaults: the server listens on 127.0.0.1 unless told otherwise (``--host``), and
Triton's administrative APIs (:data:`RESTRICTED_APIS`: model load/unload, shared-memory
registration, tracing, logging) answer only requests that carry the admin key in the header
:data:`ADMIN_KEY_HEADER` (gRPC: :data:`GRPC_ADMIN_KEY_HEADER`). The key is ``--admin-key``, else
``$NIGHTDRAFT_ADMIN_KEY``, else a random one per start that is never shown, which closes them.
tritonserver 2.51 takes the key only on its command line (``--http-restricted-api``; no
variable, no file), so it is in ``/proc/<pid>/cmdline`` of the server process for any local user
who can list processes (a container's PID namespace, or /proc mounted with ``hidepid``, limits
who that is); the variable keeps it off ``nightdraft serve``'s own command line only.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import hashlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from client.backend_dir import backend_model_digest, install_backend, is_installed, overlay_backend_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"

# Triton's API groups that administer the server rather than serve it: load/unload a model (with a
# config override that is code execution through the Python backend), register host memory
# regions, start tracing, change logging. Inference, health, metadata and statistics stay open.
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
ADMIN_KEY_ENV = "NIGHTDRAFT_ADMIN_KEY"
ADMIN_KEY_HEADER = "nightdraft-admin-key"
# Triton 2.51 expects the gRPC metadata key with this prefix (it says so when it refuses a call).
GRPC_ADMIN_KEY_HEADER = "triton-grpc-protocol-" + ADMIN_KEY_HEADER
# Triton parses "<apis>:<key>=<value>", and the value travels in a header: no separators, no spaces.
_ADMIN_KEY_RE = re.compile(r"[A-Za-z0-9._~+/-]{16,}")


# Requests to the server this process started go straight to it, whatever http_proxy says.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class LauncherError(RuntimeError):
    """The server could not be found, laid out or started; the message says why."""


# --------------------------------------------------------------------------------------------
# Finding a server


@dataclass
class TritonInstall:
    """A runnable server: the binary, the backend directory to pass (None: the server's
    default), and extra shared-library directories it needs."""
    binary: Path
    backend_dir: Path | None = None
    lib_dirs: list[Path] = field(default_factory=list)
    source: str = ""   # "explicit" | "path" | "pytriton"


def _pytriton_root() -> Path | None:
    try:
        import importlib.util
        spec = importlib.util.find_spec("pytriton")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _pytriton_libs(root: Path) -> Path | None:
    for cand in (root.parent / "nvidia_pytriton.libs", root / "tritonserver" / "external_libs"):
        if cand.is_dir():
            return cand
    return None


def _python_lib_dir() -> Path | None:
    """The directory holding this interpreter's libpython, which the stub links against."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return None
    libdir = sysconfig.get_config_var("LIBDIR")
    ldlib = sysconfig.get_config_var("LDLIBRARY")
    if libdir and ldlib and Path(libdir, ldlib).exists():
        return Path(libdir)
    return None


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "nightdraft"


def layout_python_backend(triton_dist: Path, dest_root: Path | None = None) -> Path:
    """Build ``<dest>/python/{libtriton_python.so, triton_python_backend_utils.py,
    triton_python_backend_stub}`` and ``<dest>/nightdraft/model.py`` from a pytriton
    ``tritonserver`` folder; returns ``<dest>`` (the value for ``--backend-directory``). Built
    once, atomically, per source, Python and nightdraft backend."""
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    src_backend = triton_dist / "backends" / "python"
    stub = triton_dist / "python_backend_stubs" / ver / "triton_python_backend_stub"
    lib = src_backend / "libtriton_python.so"
    if not lib.is_file():
        raise LauncherError(f"no libtriton_python.so under {src_backend}")
    if not stub.is_file():
        have = sorted(p.name for p in (triton_dist / "python_backend_stubs").glob("*"))
        raise LauncherError(f"the Triton wheel has no Python backend stub for Python {ver} "
                            f"(it has: {', '.join(have) or 'none'}); use one of those Pythons")
    key = hashlib.sha256(backend_model_digest().encode())
    for p in (lib, stub):
        st = p.stat()
        key.update(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode())
    dest = (dest_root or _cache_root()) / f"triton-backends-py{ver}-{key.hexdigest()[:12]}"
    if (dest / "python" / "triton_python_backend_stub").is_file() and is_installed(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        (tmp / "python").mkdir()
        shutil.copy2(lib, tmp / "python" / "libtriton_python.so")
        utils = src_backend / "triton_python_backend_utils.py"
        if utils.is_file():
            shutil.copy2(utils, tmp / "python" / utils.name)
        shutil.copy2(stub, tmp / "python" / "triton_python_backend_stub")
        os.chmod(tmp / "python" / "triton_python_backend_stub", 0o755)
        install_backend(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process won the race; its copy is as good as ours
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def find_tritonserver(explicit: str | os.PathLike | None = None) -> TritonInstall:
    explicit = explicit or os.environ.get("NIGHTDRAFT_TRITONSERVER")
    pyroot = _pytriton_root()
    if explicit:
        binary = Path(explicit).expanduser()
        if binary.is_dir():
            binary = binary / "bin" / "tritonserver" if (binary / "bin").is_dir() else binary / "tritonserver"
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise LauncherError(f"--tritonserver {explicit}: not an executable file")
        binary = binary.resolve()
        # The pytriton layout: stubs beside, not inside, the backend directory.
        dist = binary.parent.parent
        if (dist / "python_backend_stubs").is_dir():
            libs = _pytriton_libs(dist.parent) if dist.parent.name == "pytriton" else None
            return TritonInstall(binary, layout_python_backend(dist), [p for p in (libs,) if p], "explicit")
        return TritonInstall(binary, None, [], "explicit")
    on_path = shutil.which("tritonserver")
    if on_path:
        return TritonInstall(Path(on_path).resolve(), None, [], "path")
    if pyroot is not None:
        dist = pyroot / "tritonserver"
        binary = dist / "bin" / "tritonserver"
        if binary.is_file():
            libs = _pytriton_libs(pyroot)
            return TritonInstall(binary, layout_python_backend(dist), [p for p in (libs,) if p], "pytriton")
    raise LauncherError(
        "no tritonserver found: pass --tritonserver PATH, put tritonserver on PATH (NGC image), "
        "or install the serve extra (pip install -e '.[serve]', which brings nvidia-pytriton)")


def server_backend_dir(binary: Path) -> Path:
    """The backend directory a tritonserver uses unless told otherwise (``bin/../backends``:
    ``/opt/tritonserver/backends`` in NGC images)."""
    return Path(binary).resolve().parent.parent / "backends"


def with_nightdraft_backend(install: TritonInstall) -> TritonInstall:
    """The install, pointed at a backend directory that holds the current nightdraft backend:
    its own when it does (or when it has no Python backend to run one: then nothing helps), else
    an overlay in the cache (``client.backend_dir.overlay_backend_dir``)."""
    if install.backend_dir is not None:   # laid out by us (the pytriton wheel): nightdraft is in it
        return install
    own = server_backend_dir(install.binary)
    if is_installed(own) or not (own / "python").is_dir():
        return install
    return dataclasses.replace(install, backend_dir=overlay_backend_dir(own, _cache_root()))


def server_env(install: TritonInstall, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    bindir = Path(sys.prefix) / "bin" if sys.prefix != sys.base_prefix else Path(sys.executable).parent
    env["PATH"] = os.pathsep.join([str(bindir)] + [p for p in env.get("PATH", "").split(os.pathsep) if p])
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    libdirs = [str(p) for p in install.lib_dirs]
    pylib = _python_lib_dir()
    if pylib is not None and install.source != "path":
        libdirs.insert(0, str(pylib))
    if libdirs:
        old = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libdirs + old)
    # The Python backend stub builds its own sys.path (PYTHONPATH is not honoured); the
    # backend's model.py falls back to this directory when the package is not installed.
    if (REPO_ROOT / "backend" / "__init__.py").is_file():
        env.setdefault("NIGHTDRAFT_ROOT", str(REPO_ROOT))
    # The stub must see numpy < 2 and this environment; never a user site directory.
    env.setdefault("PYTHONNOUSERSITE", "1")
    return env


# --------------------------------------------------------------------------------------------
# Running it


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: die with the launcher


def resolve_admin_key(explicit: str | None, env: dict[str, str]) -> str:
    """The key for the restricted APIs: ``explicit``, else ``$NIGHTDRAFT_ADMIN_KEY`` (empty counts
    as unset, as compose passes an unset variable), else a random one nobody is told."""
    key = explicit if explicit is not None else env.get(ADMIN_KEY_ENV) or None
    if key is None:
        return secrets.token_urlsafe(32)
    if not _ADMIN_KEY_RE.fullmatch(key):
        raise LauncherError(f"the admin key ({'--admin-key' if explicit is not None else '$' + ADMIN_KEY_ENV}) "
                            "must be at least 16 characters of A-Z a-z 0-9 . _ ~ + / - "
                            "(e.g. openssl rand -hex 32)")
    return key


def _answers(url: str) -> bool:
    """Does this local URL answer 200?"""
    try:   # never through a proxy (http_proxy in the environment): the server is local
        with _NO_PROXY.open(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class TritonServer:
    """A ``tritonserver`` child process. Use as a context manager or start()/stop()."""

    def __init__(self, model_repository: str | os.PathLike = DEFAULT_MODEL_REPOSITORY, *,
                 http_port: int = 8000, grpc_port: int = 8001, metrics_port: int = 8002,
                 host: str = "127.0.0.1", tritonserver: str | os.PathLike | None = None,
                 log_file: str | os.PathLike | None = None, log_verbose: int = 0,
                 exit_timeout_s: int = 30, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, models: list[str] | None = None,
                 admin_key: str | None = None, cores: list[int] | None = None):
        """`cores`: the CPU cores the server's process may run on (None: those of the thread
        that starts it, which a child inherits: a benchmark that pinned its own thread to one
        core passes the machine's, or the whole server, its backend stubs and drafter workers
        included, would share that core)."""
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise LauncherError(f"model repository {self.model_repository} is not a directory")
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.host = host
        self.install = with_nightdraft_backend(find_tritonserver(tritonserver))
        self.log_file = Path(log_file) if log_file else None
        self.log_verbose = log_verbose
        self.exit_timeout_s = exit_timeout_s
        self.extra_args = list(extra_args or [])
        self.models = models
        self.cores = sorted(cores) if cores is not None else None
        self.env = server_env(self.install, env)
        self.admin_key = resolve_admin_key(admin_key, self.env)
        self.proc: subprocess.Popen | None = None
        self._log_fh = None
        self._tail: list[str] = []
        self._pump: threading.Thread | None = None
        self.echo = False  # without a log file: copy the server's log to stderr (serve does)

    # endpoints as a client on this machine reaches them
    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host

    @property
    def http_url(self) -> str:
        return f"{self._client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        cmd = [str(self.install.binary), f"--model-repository={self.model_repository}",
               f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
               f"--metrics-port={self.metrics_port}", f"--http-address={self.host}",
               f"--grpc-address={self.host}", f"--metrics-address={self.host}",
               "--allow-metrics=true", "--allow-gpu-metrics=false",
               f"--exit-timeout-secs={self.exit_timeout_s}", f"--log-verbose={self.log_verbose}"]
        if self.install.backend_dir is not None:
            cmd.append(f"--backend-directory={self.install.backend_dir}")
            cmd.append(f"--cache-directory={self.install.backend_dir}")
        restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_KEY_HEADER}={self.admin_key}"
        cmd += [f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}"]
        if self.models is not None:
            cmd.append("--model-control-mode=explicit")
            cmd += [f"--load-model={m}" for m in self.models]
        return cmd + self.extra_args

    def start(self) -> "TritonServer":
        if self.proc is not None:
            raise LauncherError("server already started")
        cmd = self.command()
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            self._log_fh = open(self.log_file, "ab", buffering=0)
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=self._in_child)
        self._pump = threading.Thread(target=self._pump_output, name="tritonserver-log", daemon=True)
        self._pump.start()
        return self

    def _in_child(self) -> None:   # between fork and exec
        _set_pdeathsig()
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)

    def _pump_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            if self._log_fh is not None:
                with contextlib.suppress(Exception):
                    self._log_fh.write(raw)
            elif self.echo:
                with contextlib.suppress(Exception):
                    sys.stderr.buffer.write(raw)
                    sys.stderr.flush()
            self._tail.append(raw.decode("utf-8", "replace").rstrip("\n"))
            if len(self._tail) > 400:
                del self._tail[:200]

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self._tail[-n:])

    def is_ready(self) -> bool:
        """Ready to serve on every endpoint this launcher prints: tritonserver opens its
        metrics port after HTTP reports ready, so a scrape right after health/ready can be
        refused; both must answer."""
        return (_answers(f"http://{self.http_url}/v2/health/ready")
                and (not self.serves_metrics or _answers(self.metrics_url)))

    @property
    def serves_metrics(self) -> bool:
        """False when the extra arguments turn metrics off (the last --allow-metrics wins)."""
        cmd = self.command()
        values = [a.split("=", 1)[1] if "=" in a else (cmd[i + 1] if i + 1 < len(cmd) else "true")
                  for i, a in enumerate(cmd) if a.split("=", 1)[0] == "--allow-metrics"]
        return values[-1].lower() not in ("false", "0", "no", "off")

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None:
                raise LauncherError("server not started")
            rc = self.proc.poll()
            if rc is not None:
                time.sleep(0.2)  # let the log pump catch the last lines
                raise LauncherError(f"tritonserver exited with code {rc} before it was ready; "
                                    f"last log lines:\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        raise LauncherError(f"tritonserver not ready after {timeout_s:.0f} s; last log lines:\n{self.log_tail()}")

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGINT (Triton's graceful shutdown: it waits for in-flight requests up to
        --exit-timeout-secs, then unloads models), then SIGKILL if it overstays."""
        proc = self.proc
        if proc is None:
            return None
        timeout_s = self.exit_timeout_s + 15 if timeout_s is None else timeout_s
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        # Python backend stubs live in the server's session; make sure none outlive it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if self._pump is not None:
            self._pump.join(timeout=5)
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        return proc.returncode

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop(timeout_s=10)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------
# nightdraft serve


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="start Triton with the nightdraft model repository",
                              description="Start tritonserver on a model repository (default: the "
                                          "bundled one, tiny model pair on the CPU), wait until it is "
                                          "ready, print the endpoints; Ctrl-C stops it.")
    p.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY),
                   help="Triton model repository (default: %(default)s)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--host", default="127.0.0.1",
                   help="address HTTP, gRPC and metrics listen on (default: %(default)s, this machine "
                        "only; 0.0.0.0 exposes an unauthenticated inference endpoint to the network)")
    p.add_argument("--admin-key", default=None,
                   help=f"key for Triton's administrative APIs ({', '.join(RESTRICTED_APIS)}), sent in "
                        f"the header {ADMIN_KEY_HEADER} (gRPC: {GRPC_ADMIN_KEY_HEADER}); default: "
                        f"${ADMIN_KEY_ENV}, else a random key that is not shown, which closes them. "
                        "Either way tritonserver gets the key on its command line (it has no other "
                        "way to take it), where local users who can list its processes can read it; "
                        "the variable keeps it out of this command's own command line and your "
                        "shell history")
    p.add_argument("--tritonserver", default=None,
                   help="path to a tritonserver binary (default: $NIGHTDRAFT_TRITONSERVER, then "
                        "tritonserver on PATH, then the nvidia-pytriton wheel's)")
    p.add_argument("--model", action="append", dest="models", default=None,
                   help="load only this model (repeatable; default: every model in the repository)")
    p.add_argument("--log-file", default=None, help="write the server log here instead of stderr")
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    p.add_argument("--exit-timeout", type=int, default=30,
                   help="seconds Triton waits for in-flight requests on shutdown")
    p.add_argument("extra", nargs=argparse.REMAINDER,
                   help="after --, more tritonserver arguments")
    p.set_defaults(func=serve_main)
    return p


def server_from_args(args: argparse.Namespace, env: dict[str, str] | None = None) -> TritonServer:
    """The server ``nightdraft serve`` would start for these arguments (``env``: its environment)."""
    extra = [a for a in (args.extra or []) if a != "--"]
    return TritonServer(args.model_repository, http_port=args.http_port, grpc_port=args.grpc_port,
                        metrics_port=args.metrics_port, host=args.host,
                        tritonserver=args.tritonserver, log_file=args.log_file,
                        log_verbose=args.log_verbose, exit_timeout_s=args.exit_timeout,
                        extra_args=extra, models=args.models, admin_key=args.admin_key, env=env)


def serve_main(args: argparse.Namespace) -> int:
    try:
        server = server_from_args(args)
    except LauncherError as e:
        print(f"nightdraft serve: {e}", file=sys.stderr)
        return 2
    server.echo = args.log_file is None
    keyed = server.admin_key in (args.admin_key, server.env.get(ADMIN_KEY_ENV))  # else random
    admin = (f"{', '.join(RESTRICTED_APIS)}: with header {ADMIN_KEY_HEADER}" if keyed else
             f"{', '.join(RESTRICTED_APIS)}: closed (set ${ADMIN_KEY_ENV} to open them)")
    if server.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"nightdraft serve: listening on {server.host}: inference and metrics take no "
              "authentication, so whoever reaches these ports can use them", file=sys.stderr)
    print(f"nightdraft serve: starting {server.install.binary} ({server.install.source})\n"
          f"  model repository: {server.model_repository}", file=sys.stderr, flush=True)

    stop = threading.Event()

    def on_signal(signum, _frame):
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        deadline = time.monotonic() + args.ready_timeout
        while not stop.is_set():
            rc = server.proc.poll()
            if rc is not None:
                time.sleep(0.2)
                print(f"nightdraft serve: tritonserver exited with code {rc}\n{server.log_tail()}",
                      file=sys.stderr)
                return rc or 1
            if server.is_ready():
                break
            if time.monotonic() > deadline:
                print(f"nightdraft serve: not ready after {args.ready_timeout:.0f} s", file=sys.stderr)
                return 1
            time.sleep(0.25)
        if not stop.is_set():
            print("\nnightdraft serve: ready\n"
                  f"  HTTP     http://{server.http_url}   (POST /v2/models/nightdraft/generate_stream)\n"
                  f"  gRPC     {server.grpc_url}\n"
                  f"  metrics  {server.metrics_url}\n"
                  f"  admin    {admin}\n"
                  f"  try:     nightdraft complete \"def fibonacci(n):\" --url {server.grpc_url}\n"
                  "  Ctrl-C stops the server.", flush=True)
        while not stop.is_set():
            if server.proc.poll() is not None:
                print(f"nightdraft serve: tritonserver exited with code {server.proc.returncode}",
                      file=sys.stderr)
                return server.proc.returncode or 1
            stop.wait(0.5)
        print("\nnightdraft serve: stopping ...", file=sys.stderr, flush=True)
        return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        rc = server.stop()
        if rc is not None:
            print(f"nightdraft serve: tritonserver stopped (exit code {rc})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nightdraft")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
