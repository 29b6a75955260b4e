"""The local broker secured as a real deployment is: SASL_SSL, SCRAM users, ACLs enforced.

`detok broker start --security sasl-ssl` runs `workers.local.broker`'s broker with:

- one client listener, SASL_SSL: TLS with a certificate for 127.0.0.1 and localhost signed by a
  CA generated for this data directory (`openssl`), and SCRAM-SHA-512 logins;
- KRaft's StandardAuthorizer with `allow.everyone.if.no.acl.found=false`: a principal may do only
  what an ACL grants it (`detok acls grant`);
- a super user `admin` (the broker's own inter-broker login too) and the users `worker`,
  `reader` and `producer`, created when the storage is formatted (`--add-scram`, KIP-900), so
  they exist before any client connects.

Why the controller listener stays PLAINTEXT on loopback: in a combined broker+controller the
broker registers with its own controller over that listener, and KRaft does not accept SCRAM
there (SCRAM credentials live in the metadata log the controller is still loading). It is
bound to 127.0.0.1 and serves only controller requests; the principal it sees, User:ANONYMOUS,
must be a super user for the broker to register. Anyone who can open loopback sockets on this
host could therefore reach the controller: acceptable for a local test broker, and the reason
a production cluster secures its controller listener too (mTLS or SASL PLAIN).

The data directory gains:

    security/ca.pem, ca.key            the CA (clients trust ca.pem)
    security/broker.pem                the broker's key and certificate (PEM keystore)
    security/credentials.json          the generated passwords (mode 0600)
    admin.properties, worker.properties, reader.properties, producer.properties
                                       librdkafka client configs (`--kafka-config FILE`)

Certificates and passwords are made once per data directory and reused on a restart, so the
client files stay valid.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from workers.kafka.config import read_properties_file
from workers.local import broker
from workers.local.broker import BrokerError, BrokerSecurity, RunningBroker

USERS = ("admin", "worker", "reader", "producer")
SUPER_USER = "admin"
MECHANISM = "SCRAM-SHA-512"
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
# A year: a local broker's data directory is thrown away long before; a CI run never sees expiry.
CERT_DAYS = 365
# openssl makes a 2048-bit key in well under a second; 60 s only guards against a wedged process.
OPENSSL_TIMEOUT_S = 60


@dataclass(frozen=True)
class SecureBroker:
    """A running secured broker and the client config file of each user."""

    running: RunningBroker
    client_configs: dict[str, Path]  # user -> properties file

    @property
    def bootstrap_servers(self) -> str:
        return self.running.bootstrap_servers


def start_secure_broker(
    port: int = broker.DEFAULT_PORT, data_dir: Path = broker.DEFAULT_DATA_DIR
) -> SecureBroker:
    """Start (or find running) the SASL_SSL broker of `data_dir`; see the module docstring."""
    data_dir = data_dir.resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    security_dir = data_dir / "security"
    security_dir.mkdir(exist_ok=True)
    ca, keystore = _certificates(security_dir)
    passwords = _passwords(security_dir / "credentials.json")
    configs = {
        user: _write_client_config(data_dir / f"{user}.properties", user, passwords[user], ca)
        for user in USERS
    }
    running = broker.start_broker(port, data_dir, _security(port, ca, keystore, passwords))
    return SecureBroker(running, configs)


def probe_properties(data_dir: Path) -> dict[str, str]:
    """The admin's client settings if `data_dir` holds a secured broker, else none (plaintext),
    so `detok broker status` asks a secured broker as a client it accepts."""
    admin = data_dir.resolve() / f"{SUPER_USER}.properties"
    return read_properties_file(admin) if admin.is_file() else {}


def client_properties(user: str, password: str, ca: Path) -> dict[str, str]:
    """The librdkafka settings of one SCRAM user of this broker."""
    return {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": MECHANISM,
        "sasl.username": user,
        "sasl.password": password,
        "ssl.ca.location": str(ca),
    }


def _security(port: int, ca: Path, keystore: Path, passwords: dict[str, str]) -> BrokerSecurity:
    controller = f"CONTROLLER://{broker.LOOPBACK}:{port + 1}"
    login = (
        "org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="{SUPER_USER}" password="{passwords[SUPER_USER]}";'
    )
    server = {
        "listeners": f"SASL_SSL://{broker.LOOPBACK}:{port},{controller}",
        "advertised.listeners": f"SASL_SSL://{broker.LOOPBACK}:{port}",
        "inter.broker.listener.name": "SASL_SSL",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL",
        "sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config": login,
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(keystore),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(ca),
        "authorizer.class.name": AUTHORIZER,
        # ANONYMOUS: the broker's registration over the PLAINTEXT controller listener (see the
        # module docstring); admin: the inter-broker login and the operator.
        "super.users": f"User:{SUPER_USER};User:ANONYMOUS",
        "allow.everyone.if.no.acl.found": "false",
    }
    scram = []
    for user, password in passwords.items():
        scram += ["--add-scram", f"{MECHANISM}=[name={user},password={password}]"]
    probe = client_properties(SUPER_USER, passwords[SUPER_USER], ca)
    return BrokerSecurity(server, tuple(scram), probe)


def _passwords(path: Path) -> dict[str, str]:
    """Each user's password: generated once, then read back so client files stay valid."""
    if path.exists():
        stored = json.loads(path.read_text())
        if set(stored) == set(USERS):
            return stored
    passwords = {user: secrets.token_urlsafe(18) for user in USERS}
    path.touch(mode=0o600)
    path.write_text(json.dumps(passwords, indent=2) + "\n")
    return passwords


def _write_client_config(path: Path, user: str, password: str, ca: Path) -> Path:
    lines = [f"# detok local broker (SASL_SSL, {MECHANISM}): user {user}"]
    lines += [f"{key}={value}" for key, value in client_properties(user, password, ca).items()]
    path.touch(mode=0o600)
    path.write_text("\n".join(lines) + "\n")
    return path


def _certificates(security_dir: Path) -> tuple[Path, Path]:
    """The CA certificate and the broker's PEM keystore (key + certificate), made if missing.

    The broker certificate names 127.0.0.1 and localhost, so clients verify the host name as
    they would against a real cluster (librdkafka checks it by default).
    """
    ca, ca_key = security_dir / "ca.pem", security_dir / "ca.key"
    keystore = security_dir / "broker.pem"
    if ca.exists() and keystore.exists():
        return ca, keystore
    openssl = shutil.which("openssl")
    if openssl is None:
        raise BrokerError("`openssl` is not on PATH; it makes the local broker's certificates")
    key, request, cert = (security_dir / name for name in ("broker.key", "broker.csr", "b.crt"))
    extensions = security_dir / "broker.ext"
    extensions.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    days = str(CERT_DAYS)
    _openssl(
        openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key,
        "-out", ca, "-days", days, "-subj", "/CN=detok local CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    _openssl(
        openssl, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request,
        "-subj", "/CN=localhost",
    )  # fmt: skip
    _openssl(
        openssl, "x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key,
        "-CAcreateserial", "-out", cert, "-days", days, "-extfile", extensions,
    )  # fmt: skip
    keystore.touch(mode=0o600)
    keystore.write_text(key.read_text() + cert.read_text() + ca.read_text())
    for leftover in (key, request, cert, extensions, security_dir / "ca.srl"):
        leftover.unlink(missing_ok=True)
    ca_key.chmod(0o600)
    return ca, keystore


def _openssl(*command: str | Path) -> None:
    result = subprocess.run(
        [str(part) for part in command],
        capture_output=True,
        text=True,
        timeout=OPENSSL_TIMEOUT_S,
        check=False,
    )
    if result.returncode != 0:
        raise BrokerError(f"openssl {command[1]} failed: {result.stderr.strip()[-2000:]}")
