"""A TCP listener that serves only connections proving a shared key: the
elastic driver's (elastic_run.py) and unison.run()'s (run_function.py).

The proof is multiprocessing's connection handshake (an HMAC challenge each
way, so the key never crosses the network): clients connect with
multiprocessing.connection.Client(address, authkey=key). It runs on each
connection's own thread rather than in accept(), as Listener(authkey=)
would: there a peer that connects and says nothing would hold up every
connection behind it."""
import socket
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Listener, answer_challenge, deliver_challenge


class KeyedListener:
    def __init__(self, bind, key, serve, refused=None):
        """Listens on (bind, a free port) and calls serve(connection) on a
        thread of its own for each connection that proves `key` (bytes);
        refused(error), if given, hears of each that does not."""
        self._key, self._serve, self._refused = key, serve, refused
        # Listener's own backlog is 1. Every worker of an elastic job
        # connects at once, at its start and at each round's, and Linux
        # drops the handshake's last packet of a connection that finds the
        # accept queue full: the client believes it is connected and waits
        # for a challenge the listener never sends. 64 clients at once hung
        # that way for good. The kernel caps this at net.core.somaxconn.
        self._listener = Listener((bind, 0), backlog=socket.SOMAXCONN)
        self.address = self._listener.address
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            listener = self._listener
            if listener is None:  # closed between two connections
                return
            try:
                connection = listener.accept()
            except OSError:
                if self._listener is None:
                    return
                continue  # a dropped connection
            threading.Thread(target=self._prove, args=(connection,), daemon=True).start()

    def _prove(self, connection):
        try:
            deliver_challenge(connection, self._key)
            answer_challenge(connection, self._key)
        except (AuthenticationError, EOFError, OSError) as e:
            connection.close()
            if self._refused is not None and isinstance(e, AuthenticationError):
                self._refused(e)
            return
        self._serve(connection)

    def close(self):
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
