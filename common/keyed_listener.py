"""A TCP listener that serves only connections proving a shared key: the
elastic driver's (runner/elastic_driver.py) and unison.run()'s (runner/function.py).
Clients connect with connect(address, key).

The proof is a challenge each way, answered with HMAC-SHA256, so the key
never crosses the network: multiprocessing's own handshake, used before,
answers with MD5 on Python 3.11. Once proven, both ends talk through a
multiprocessing Connection (pickled objects): nothing is unpickled before
the peer has proven the key.

A stranger costs the listener little. Each connection is proven on a thread
of its own, so one that connects and says nothing holds up nobody behind
it; it is given HANDSHAKE_SECONDS to prove the key, then dropped; at most
MAX_PENDING connections are being proven at once (the rest wait in the
kernel's queue); and when the process runs out of file descriptors the
accept loop backs off instead of spinning."""
import errno
import hashlib
import hmac
import os
import socket
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection

HANDSHAKE_SECONDS = 10.0
MAX_PENDING = 128
_NONCE = 32
_DIGEST = hashlib.sha256().digest_size


def _proof(key, role, first, second):
    return hmac.new(key, role + first + second, hashlib.sha256).digest()


def _receive_exactly(sock, count):
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise EOFError("the peer closed the connection during the handshake")
        data += chunk
    return data


def _listener_side(sock, key):
    """Proves the peer knows `key`, and proves it back. Raises
    AuthenticationError for a wrong proof."""
    mine = os.urandom(_NONCE)
    sock.sendall(mine)
    answer = _receive_exactly(sock, _NONCE + _DIGEST)
    theirs, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _proof(key, b"client", mine, theirs)):
        raise AuthenticationError("the peer did not prove the job's key")
    sock.sendall(_proof(key, b"listener", theirs, mine))


def connect(address, key, timeout=HANDSHAKE_SECONDS):
    """A Connection to a KeyedListener at `address` that holds `key`.
    Raises AuthenticationError where the listener does not prove the key,
    OSError where it cannot be reached or answers too slowly."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        theirs = _receive_exactly(sock, _NONCE)
        mine = os.urandom(_NONCE)
        sock.sendall(mine + _proof(key, b"client", theirs, mine))
        try:
            answer = _receive_exactly(sock, _DIGEST)
        except EOFError:  # the listener hangs up on a wrong proof
            raise AuthenticationError("the listener at %s:%d refused this key" % tuple(address[:2])) from None
        if not hmac.compare_digest(answer, _proof(key, b"listener", mine, theirs)):
            raise AuthenticationError("the listener at %s:%d did not prove the job's key" % tuple(address[:2]))
        sock.settimeout(None)
        return Connection(sock.detach())
    except BaseException:
        sock.close()
        raise


class KeyedListener:
    def __init__(self, bind, key, serve, refused=None):
        """Listens on (bind, a free port) and calls serve(connection) on a
        thread of its own for each connection that proves `key` (bytes);
        refused(error), if given, hears of each that does not."""
        self._key, self._serve, self._refused = key, serve, refused
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._socket = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((bind, 0))
        # Every worker of an elastic job connects at once, at its start and
        # at each round's, and Linux drops the handshake's last packet of a
        # connection that finds the accept queue full: the client believes
        # it is connected and waits for a challenge that never comes (64
        # clients at once hung so with multiprocessing's backlog of 1). The
        # kernel caps this at net.core.somaxconn.
        self._socket.listen(socket.SOMAXCONN)
        self.address = self._socket.getsockname()[:2]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._closed:
            self._pending.acquire()
            try:
                sock, _ = self._socket.accept()
            except OSError as e:
                self._pending.release()
                if self._closed:
                    return
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    time.sleep(0.1)  # out of descriptors: a retry at once would spin until one frees
                continue  # a connection dropped before it was accepted
            threading.Thread(target=self._prove, args=(sock,), daemon=True).start()

    def _prove(self, sock):
        try:
            try:
                sock.settimeout(HANDSHAKE_SECONDS)
                _listener_side(sock, self._key)
                sock.settimeout(None)
            except (AuthenticationError, EOFError, OSError) as e:
                sock.close()
                if self._refused is not None and isinstance(e, AuthenticationError):
                    self._refused(e)
                return
        finally:
            self._pending.release()
        self._serve(Connection(sock.detach()))

    def close(self):
        if not self._closed:
            self._closed = True
            # shutdown() wakes the accept loop, which close() alone may not.
            try:
                self._socket.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._socket.close()
