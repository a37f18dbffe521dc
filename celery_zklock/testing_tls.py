"""Throwaway TLS material for a TLS-only test ZooKeeper (:class:`TlsMaterial`).

Why made at test time with ``openssl``: committed certificates expire and break the suite
on a date nobody chose; these live for two days in a temporary directory.  Standard
library only (and the ``openssl`` command).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile


class TlsMaterial:
    """A throwaway CA, a server certificate for 127.0.0.1 and client certificates, made
    with ``openssl`` in a temporary directory at test time (nothing committed can expire).

    Files (PEM): ``ca``, ``server`` (key + certificate, what ZooKeeper's PEM keystore
    reads), ``client_cert``/``client_key`` signed by the CA, ``client_key_encrypted``
    (password :attr:`KEY_PASSWORD`), and ``rogue_ca`` with ``rogue_cert``/``rogue_key``:
    a second CA the server does not trust, for the wrong-CA cases.
    """

    KEY_PASSWORD = "test-key-password"

    def __init__(self, workdir: str | None = None) -> None:
        self.workdir = workdir or tempfile.mkdtemp(prefix="zklock-tls-")
        self._own = workdir is None
        d = self.workdir
        self.ca, self.ca_key = f"{d}/ca.pem", f"{d}/ca.key"
        self.server = f"{d}/server-keystore.pem"
        self.client_cert, self.client_key = f"{d}/client.pem", f"{d}/client.key"
        self.client_key_encrypted = f"{d}/client-encrypted.key"
        self.rogue_ca, self.rogue_ca_key = f"{d}/rogue-ca.pem", f"{d}/rogue-ca.key"
        self.rogue_cert, self.rogue_key = f"{d}/rogue-client.pem", f"{d}/rogue-client.key"
        self._make()

    def _openssl(self, *args: str) -> None:
        proc = subprocess.run(["openssl", *args], cwd=self.workdir, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stderr[-2000:]}")

    # The extensions RFC 5280 asks for, which Python >= 3.13's default context checks
    # (ssl.VERIFY_X509_STRICT): a CA with keyUsage, certificates with an authority key id.
    # Without them ``ssl.create_default_context`` (four_letter_word's TLS probe) refused the
    # CA ("CA cert does not include key usage extension"), and a TLS server never came up.
    def _ca(self, cert: str, key: str, name: str) -> None:
        self._openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                      "-days", "2", "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
                      "-addext", "keyUsage=critical,keyCertSign,cRLSign")

    def _signed(self, cert: str, key: str, ca: str, ca_key: str, name: str, san: str | None = None) -> None:
        csr = f"{cert}.csr"
        self._openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
        ext = f"{cert}.ext"
        with open(os.path.join(self.workdir, ext), "w") as f:
            f.write("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                    "extendedKeyUsage=serverAuth,clientAuth\nsubjectKeyIdentifier=hash\n"
                    "authorityKeyIdentifier=keyid,issuer\n" + (f"subjectAltName={san}\n" if san else ""))
        self._openssl("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
                      "-days", "2", "-extfile", ext)

    def _make(self) -> None:
        self._ca(self.ca, self.ca_key, "celery-zklock test CA")
        self._ca(self.rogue_ca, self.rogue_ca_key, "rogue CA")
        server_cert, server_key = f"{self.workdir}/server.pem", f"{self.workdir}/server.key"
        self._signed(server_cert, server_key, self.ca, self.ca_key, "127.0.0.1", san="IP:127.0.0.1,DNS:localhost")
        with open(self.server, "w") as out:  # ZooKeeper's PEM keystore: the key, then the certificate
            for part in (server_key, server_cert):
                with open(part) as f:
                    out.write(f.read())
        self._signed(self.client_cert, self.client_key, self.ca, self.ca_key, "worker")
        self._openssl("pkey", "-in", self.client_key, "-out", self.client_key_encrypted, "-aes256",
                      "-passout", f"pass:{self.KEY_PASSWORD}")
        self._signed(self.rogue_cert, self.rogue_key, self.rogue_ca, self.rogue_ca_key, "intruder")

    def client_options(self) -> dict:
        """``zklock_use_ssl`` for a client this server accepts."""
        return {"ca": self.ca, "certfile": self.client_cert, "keyfile": self.client_key}

    def close(self) -> None:
        if self._own:
            shutil.rmtree(self.workdir, ignore_errors=True)
