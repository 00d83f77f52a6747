"""systemd's notify protocol (sd_notify(3)) without libsystemd: one datagram per message.

The supervisor says READY=1 once every worker answered, and WATCHDOG=1 from its loop, so a
unit with ``Type=notify`` is "started" only when it can serve, and ``WatchdogSec=`` restarts
a supervisor whose loop stopped turning. Outside systemd (no ``$NOTIFY_SOCKET``) every call
is a no-op.
"""

from __future__ import annotations

import os
import socket
import time

__all__ = ["Notifier"]


class Notifier:
    def __init__(self, environ=None):
        env = os.environ if environ is None else environ
        path = env.get("NOTIFY_SOCKET", "")
        # "@name" is an abstract socket (a leading NUL byte); anything else a path.
        self._address = ("\0" + path[1:]) if path.startswith("@") else path
        self._sock = None
        watchdog_us = env.get("WATCHDOG_USEC", "")
        watchdog_pid = env.get("WATCHDOG_PID", "")
        # Ping at half the watchdog period, as sd_watchdog_enabled(3) advises.
        self.watchdog_interval_s = None
        ours = not watchdog_pid or watchdog_pid == str(os.getpid())
        if watchdog_us.isdigit() and int(watchdog_us) > 0 and ours:
            self.watchdog_interval_s = int(watchdog_us) / 2e6
        self._last_ping = 0.0

    @property
    def enabled(self):
        return bool(self._address)

    def send(self, *fields):
        """Send "KEY=value" fields; False when there is no socket or it refused."""
        if not self._address:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(fields).encode(), self._address)
        except OSError:
            return False
        return True

    def ready(self, status=""):
        return self.send("READY=1", *(["STATUS=" + status] if status else []))

    def status(self, text):
        return self.send("STATUS=" + text)

    def stopping(self):
        return self.send("STOPPING=1")

    def watchdog(self, now=None):
        """WATCHDOG=1 when half the period has passed since the last ping (cheap to call)."""
        if self.watchdog_interval_s is None:
            return False
        now = time.monotonic() if now is None else now
        if now - self._last_ping < self.watchdog_interval_s:
            return False
        self._last_ping = now
        return self.send("WATCHDOG=1")

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None
