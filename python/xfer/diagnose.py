"""Telling apart why a connection to an agent failed, as xferctl does (its ``diagnose`` module,
with the same texts and the client's own argument names): TLS sent to a plaintext agent,
plaintext sent to an mTLS agent, an address that is the agent's metrics or health port (HTTP/1),
no client certificate, a certificate the agent refused, an agent certificate the CA does not
vouch for, nobody listening. The address is probed once, only after a failure: one HTTP/1.0
request, and the first bytes of the answer say what listens there."""
import socket

HTTP1, TLS, PLAIN_GRPC, UNKNOWN = "http1", "tls", "plain-grpc", "unknown"


def classify(reply):
    """What the first bytes a server sent back to an HTTP/1.0 request say it speaks."""
    if reply.startswith(b"HTTP/1."):
        return HTTP1
    if len(reply) >= 2 and reply[0] == 0x15 and reply[1] == 0x03:
        return TLS
    if len(reply) >= 9 and reply[3] == 0x04:
        # An HTTP/2 frame header: 3 bytes length, type 4 (SETTINGS), the server preface.
        return PLAIN_GRPC
    return UNKNOWN


def _host_port(addr):
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        return host, int(rest.lstrip(":") or 7470)
    host, _, port = addr.rpartition(":")
    return (host, int(port)) if host else (addr, 7470)


def probe(addr, step=1.0):
    """Sends one HTTP/1.0 request to ``addr`` and classifies the answer (at most ``step``
    seconds per step); UNKNOWN when nothing useful came back."""
    try:
        with socket.create_connection(_host_port(addr), timeout=step) as s:
            s.sendall(b"GET /health HTTP/1.0\r\nHost: xfer-python\r\n\r\n")
            buf = b""
            while len(buf) < 16:
                chunk = s.recv(16 - len(buf))
                if not chunk:
                    break
                buf += chunk
    except (OSError, ValueError):
        return UNKNOWN
    return classify(buf)


_MISMATCH = ("corrupt message", "invalidcontenttype", "frame with invalid size", "broken pipe", "connection reset",
             "h2 protocol", "http2", "alert", "certificate", "tls", "ssl", "unexpected eof", "handshake", "socket closed",
             "wrong version number", "failed to connect")


def explain_with(addr, tls, client_cert, text, speaks):
    """The message for a failed connection to ``addr`` whose transport said ``text`` and whose
    probe answered ``speaks``; None when nothing better than the transport's words is known."""
    if speaks == HTTP1:
        return (f"{addr} answers HTTP/1, not gRPC: it is likely the agent's metrics/health port (metrics_listen, 9470 by "
                f"default); give the agent's gRPC address (listen, port 7470 by default)")
    if speaks == PLAIN_GRPC and tls:
        return (f"the agent at {addr} speaks plaintext (insecure = true), not TLS: leave out ca=, cert= and key= to talk "
                f"to it, or run it with mTLS")
    if speaks == TLS and not tls:
        return (f"the agent at {addr} requires mTLS and this connection was plaintext: give ca=, cert= and key=, a "
                f"client certificate and key issued by the agent's CA")
    if not tls:
        return None
    t = text.lower()
    if "certificaterequired" in t or "certificate required" in t or (not client_cert and ("alert" in t or "handshake" in t)):
        return (f"the agent at {addr} requires a client certificate (mTLS) and none was given: add cert= and key= "
                f"issued by the agent's CA")
    if "fatal alert" in t or "alert" in t and "certificate" in t:
        return (f"the agent at {addr} refused the client certificate ({text}): it must be issued by the CA in the "
                f"agent's tls.ca and be valid now (the agent counts the reason in xfer_tls_handshake_failures_total)")
    if "not valid for name" in t or "hostname mismatch" in t or "peer name" in t:
        return (f"the agent's certificate does not carry the name {addr} was reached by: pass server_name= with one of "
                f"its DNS names (e.g. the agent's node name, or the chart's xfer-agent.NAMESPACE.svc)")
    if "unknown issuer" in t or "unknownissuer" in t or "certificate verify failed" in t or "invalid peer certificate" in t:
        return f"the agent's certificate is not vouched for by ca= ({text}): give the CA that issued the agents' certificates"
    return None


def explain(addr, tls, client_cert, text):
    """``explain_with`` after probing ``addr``; None for a transport error that reads like nobody
    listening, or when the probe tells nothing."""
    t = text.lower()
    if addr.startswith("unix:") or not any(k in t for k in _MISMATCH):
        return None
    return explain_with(addr, tls, client_cert, text, probe(addr))
