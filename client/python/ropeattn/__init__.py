"""Python client of the ropeattn server: numpy arrays in and out.

    import numpy as np, ropeattn
    c = ropeattn.Client("127.0.0.1:50051")
    y = c.rope_apply(np.ones((1, 4, 2, 8), np.float32), rope={"theta": 10000})

Tensors are numpy arrays in the API's layout ([batch, seq, heads, dim]);
f32 by default, bf16 on request (`dtype="bf16"`: rounded to nearest even,
answers widened to float32). Errors are grpc.RpcError with the server's
code and message. The stubs (ropeattn/v1/*_pb2*.py) are generated from
proto/ when the package is built (setup.py) or by CMake for the tests.
"""

import collections.abc
import os
import queue
import threading
import time
import weakref

import grpc
import numpy as np
from google.protobuf import json_format

from ropeattn.v1 import attention_pb2 as pb
from ropeattn.v1 import attention_pb2_grpc as pb_grpc

__all__ = ["Client", "Session", "StepError", "to_tensor", "from_tensor"]


class StepError(Exception):
    """An operation inside a Decode stream failed (the session is unchanged
    and the stream goes on): `code` is a grpc.StatusCode, `message` the
    server's."""

    def __init__(self, code, message):
        super().__init__("%s: %s" % (code.name, message))
        self.code = code
        self.message = message

_DTYPES = {"f32": pb.DTYPE_F32, "bf16": pb.DTYPE_BF16}
# A session's KV cache may also be int8 (a scale per token and kv head).
_KV_DTYPES = {**_DTYPES, "int8": pb.DTYPE_INT8}


def _dtype(name, value, table):
    """The wire dtype of `value` in `table`; a name not there is a ValueError
    naming the argument and the accepted values (not a bare KeyError)."""
    try:
        return table[value]
    except (KeyError, TypeError):
        names = list(table)
        raise ValueError("%s must be %s or %s, got %r"
                         % (name, ", ".join(names[:-1]), names[-1], value)) from None


def _real_array(value, name, layout=None):
    """A float32 array from a numpy array or nested lists of real numbers.
    Anything else is refused naming the argument, never cast: a complex array
    lost its imaginary part; bool, string and object arrays are TypeErrors.
    `layout` (e.g. "[batch, seq, heads, dim]") checks the rank: a ValueError
    naming the argument and the expected shape."""
    try:
        a = np.asarray(value)
    except ValueError as e:  # ragged nested lists
        raise ValueError("%s must be a rectangular array: %s" % (name, e)) from None
    if a.dtype.kind not in "iuf":
        raise TypeError("%s must be an array of real numbers (integer or float), got %s"
                        % (name, a.dtype))
    if layout is not None and a.ndim != layout.count(",") + 1:
        raise ValueError("%s must be %d-D %s, got shape %s"
                         % (name, layout.count(",") + 1, layout, a.shape))
    return np.ascontiguousarray(a, dtype=np.float32)


def to_tensor(array, dtype="f32"):
    """A wire Tensor from a numpy array or nested lists of real numbers (f32,
    or bf16 rounded to nearest even); complex, bool, string or object data is
    a TypeError."""
    wire_dtype = _dtype("dtype", dtype, _DTYPES)
    a = _real_array(array, "array")
    t = pb.Tensor(dtype=wire_dtype, shape=list(a.shape))
    if dtype == "bf16":
        bits = a.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        # A NaN stays a NaN (quiet, sign kept): rounding a NaN whose payload
        # is in the low bits only would carry into the exponent and give Inf.
        rounded = np.where(np.isnan(a), (bits >> 16) | 0x40, rounded)
        t.data = rounded.astype("<u2").tobytes()
    else:
        t.data = a.astype("<f4").tobytes()
    return t


def from_tensor(t):
    """A float32 numpy array from a wire Tensor (bf16 widened exactly)."""
    shape = tuple(t.shape)
    if t.f32_values:
        return np.asarray(t.f32_values, dtype=np.float32).reshape(shape)
    if t.dtype == pb.DTYPE_BF16:
        half = np.frombuffer(t.data, dtype="<u2").astype(np.uint32) << 16
        return half.view(np.float32).reshape(shape)
    return np.frombuffer(t.data, dtype="<f4").astype(np.float32).reshape(shape)


# Every integer on the wire is an int64; protobuf's own error for one
# outside names neither the argument nor the range.
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _check_int64(value, name):
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError("%s must be in int64's range -2**63..2**63-1, got %d" % (name, value))


def _int_array(values, name):
    """A numpy array of integers from a sequence or an array (floats and
    bools are refused, not truncated or cast: a TypeError naming the
    argument; an integer outside int64 is a ValueError naming the argument
    and the range)."""
    a = np.asarray(values)
    if a.size and a.dtype.kind in "iu" and not isinstance(values, np.ndarray):
        # numpy makes [True, 2] the integers [1, 2]; _int refuses a bool.
        for x in np.asarray(values, dtype=object).reshape(-1):
            if isinstance(x, (bool, np.bool_)):
                raise TypeError("%s must be integers, got %r (a bool)" % (name, x))
    if a.size and not np.issubdtype(a.dtype, np.integer):
        if a.dtype.kind in "fO" and not isinstance(values, np.ndarray):
            # Python ints outside int64 make numpy pick float64 (2**63
            # beside 0) or object: say which value, not "got float64".
            items = np.asarray(values, dtype=object).reshape(-1)
            if all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
                   for x in items):
                for x in items:
                    _check_int64(int(x), name)
        raise TypeError("%s must be integers, got %s" % (name, a.dtype))
    if a.size and a.dtype.kind == "u":
        _check_int64(int(a.max()), name)
    return a


def _int(value, name):
    """A Python int from an int or a numpy integer (a float, even 1.0, is
    refused, not truncated: a TypeError naming the argument; one outside
    int64 is a ValueError naming the argument and the range)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError("%s must be an integer, got %r" % (name, value))
    _check_int64(int(value), name)
    return int(value)


def _ints(values, name):
    """A list of Python ints from None, a sequence or a numpy array of
    integers (floats are refused, not truncated)."""
    if values is None:
        return []
    return [int(x) for x in _int_array(values, name).reshape(-1)]


def _rope_spec(rope):
    if rope is None:
        return None
    if isinstance(rope, pb.RopeSpec):
        return rope
    if not isinstance(rope, collections.abc.Mapping):
        raise TypeError('rope must be a dict of RopeSpec fields (e.g. {"theta": 10000}) or a '
                        "RopeSpec, got %s" % type(rope).__name__)
    try:
        return json_format.ParseDict(rope, pb.RopeSpec())
    except json_format.ParseError as e:  # protobuf's, naming no argument
        raise ValueError("rope: %s" % e) from None


def _set_positional(spec, rope, alibi):
    """RoPE or ALiBi on `spec`. They are one oneof on the wire: setting both
    kept only the last (ALiBi) and the server computed something else than
    asked, so both is a ValueError, as the CLI's --alibi with a RoPE flag."""
    if rope is not None and alibi:
        raise ValueError("rope and alibi are two positional schemes; a spec has at most one: "
                         "give rope=... or alibi=True, not both")
    if rope is not None:
        spec.rope.CopyFrom(_rope_spec(rope))
    if alibi:
        spec.alibi.SetInParent()


def _check_token(token):
    """As the C++ client's CheckToken: the token goes in a header value after
    "Bearer ", which gRPC refuses unless printable ASCII (and a space would
    split it). The message names the offending position, never the token:
    grpcio's own error quotes the whole header and logs it on stderr."""
    if not isinstance(token, str):
        raise TypeError("token must be a str, got %s" % type(token).__name__)
    data = token.encode("utf-8", "surrogatepass")
    for i, c in enumerate(data):
        if c <= 0x20 or c > 0x7e:
            hint = ""
            if data[:7].lower() == b"bearer ":
                hint = '; pass the token alone, without "Bearer "'
            raise ValueError('token must be printable ASCII without spaces (it is sent as '
                             '"authorization: Bearer <token>"); character %d of %d is not%s'
                             % (i, len(data), hint))


def _valid_port(port):
    """A port as gRPC's resolvers take it: decimal digits, 1..65535. A larger
    number is not refused by gRPC (getaddrinfo keeps its low 16 bits: 116149
    dials 50613), and port 0 cannot be dialed."""
    return (0 < len(port) <= 5 and all("0" <= c <= "9" for c in port)
            and 1 <= int(port) <= 65535)


def _check_host_port(hostport, port_required, what):
    """host:port, [v6]:port or (port_required False) a host alone; `what`
    names the target in messages. As the C++ client's CheckHostPort."""
    port = None
    if hostport.startswith("["):
        close = hostport.find("]")
        if close < 0:
            raise ValueError("%s has no ']' after its IPv6 address" % what)
        host, rest = hostport[1:close], hostport[close + 1:]
        if rest:
            if not rest.startswith(":"):
                raise ValueError('%s has "%s" after its IPv6 address; give [address]:port'
                                 % (what, rest))
            port = rest[1:]
    else:
        if hostport.count(":") > 1:
            raise ValueError("%s has several ':'; write an IPv6 address in brackets, "
                             "e.g. [::1]:50051" % what)
        host, colon, rest = hostport.partition(":")
        if colon:
            port = rest
    if not host:
        raise ValueError("%s has no host" % what)
    if not port:
        if not port_required and port is None:
            return
        shown = "[%s]" % host if ":" in host else host
        raise ValueError("%s has no port; give host:port, e.g. %s:50051" % (what, shown))
    if not _valid_port(port):
        raise ValueError('%s: the port must be a number in 1..65535, got "%s"' % (what, port))


def _check_target(target):
    """A target gRPC can dial, as the C++ client's CheckTarget: a URL, a
    missing port or one outside 1..65535 (which gRPC would wrap, dialing
    another port) is a ValueError naming the target."""
    if not isinstance(target, str):
        raise TypeError("target must be a str, got %s" % type(target).__name__)
    if not target:
        raise ValueError("target must not be empty")
    what = 'target "%s"' % target
    if target.startswith(("http://", "https://", "grpc://", "grpcs://")):
        raise ValueError("%s is a URL; give host:port (e.g. 127.0.0.1:50051), and "
                         "tls_ca_file (TLS) instead of https://" % what)
    if target.startswith("dns:"):  # dns:[//authority/]host[:port]: port 443 when none
        rest = target[4:]
        if rest.startswith("//"):
            authority, slash, rest = rest[2:].partition("/")
            if not slash:
                raise ValueError("%s has no host after its authority; give dns:///host:port"
                                 % what)
            if authority:  # the DNS server to ask, host[:port]
                _check_host_port(authority, False, what + " (its DNS server)")
        _check_host_port(rest, False, what)
        return
    for scheme in ("ipv4:", "ipv6:"):  # address lists, a port each
        if not target.startswith(scheme):
            continue
        rest = target[len(scheme):]
        if rest.startswith("//"):
            if not rest.startswith("///"):
                raise ValueError("%s has an authority; give %saddress:port" % (what, scheme))
            rest = rest[3:]
        if not rest:
            raise ValueError("%s has no address" % what)
        for address in rest.split(","):
            _check_host_port(address, True, '%s address "%s"' % (what, address))
            if (scheme == "ipv6:") != address.startswith("["):
                raise ValueError('%s address "%s" is not %s' % (
                    what, address,
                    "[IPv6 address]:port" if scheme == "ipv6:" else "IPv4 address:port"))
        return
    if target.startswith("unix:"):
        if target[5:] in ("", "//", "///"):
            raise ValueError("%s has no socket path" % what)
        return
    # gRPC's other schemes and resolvers named as scheme:// (xds:///name)
    # are passed through as they are.
    if target.startswith(("unix-abstract:", "vsock:")):
        return
    scheme, sep, _ = target.partition("://")
    if sep and scheme and all(c.isascii() and (c.isalnum() or c in "+-.") for c in scheme):
        return
    _check_host_port(target, True, what)


# As the C++ client's credentials.cc: a CA bundle is a few hundred KiB; a
# file near this is the wrong one, and reading on would only use memory.
_MAX_PEM_BYTES = 16 << 20
_BEGIN_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"


def _read_pem(field, path):
    """The whole file, or a ValueError naming `field` and `path`."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_PEM_BYTES + 1)
    except OSError as e:
        raise ValueError('%s "%s" cannot be read: %s' % (field, path, e.strerror)) from None
    if len(data) > _MAX_PEM_BYTES:
        raise ValueError('%s "%s" is over %d bytes: not a PEM file'
                         % (field, path, _MAX_PEM_BYTES))
    return data


def _read_certificates(field, path):
    data = _read_pem(field, path)
    # grpcio would take anything and fail every handshake later with a bare
    # UNAVAILABLE; a wrong file is clearer now.
    if _BEGIN_CERTIFICATE not in data:
        raise ValueError('%s "%s" holds no PEM certificate (%s)'
                         % (field, path, _BEGIN_CERTIFICATE.decode()))
    return data


def _read_private_key(field, path):
    data = _read_pem(field, path)
    # PKCS#8, SEC1 and PKCS#1 all end their BEGIN line this way.
    if b"-----BEGIN " not in data or b"PRIVATE KEY-----" not in data:
        raise ValueError('%s "%s" holds no PEM private key (-----BEGIN ... PRIVATE KEY-----)'
                         % (field, path))
    # gRPC has no way to ask for a passphrase.
    if b"-----BEGIN ENCRYPTED PRIVATE KEY-----" in data or b"Proc-Type: 4,ENCRYPTED" in data:
        raise ValueError('%s "%s" holds an encrypted private key; gRPC needs it unencrypted'
                         % (field, path))
    return data


def _check_path(field, path):
    """None or a path (str, bytes, os.PathLike): open() takes an int as a
    file descriptor, and reading it would close the caller's fd (True is fd
    1, stdout)."""
    if path is not None and not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError("%s must be a path (str, bytes or os.PathLike), got %s"
                        % (field, type(path).__name__))


def _ssl_credentials(tls_ca_file, tls_cert_file, tls_key_file):
    """TLS channel credentials from the files, checked as the C++ client's
    ChannelCredentialsFor: a certificate without its key (or the reverse)
    aborted the interpreter in gRPC core."""
    if bool(tls_cert_file) != bool(tls_key_file):
        given, missing = (("tls_cert_file", "tls_key_file") if tls_cert_file
                          else ("tls_key_file", "tls_cert_file"))
        raise ValueError("tls_cert_file and tls_key_file go together (a client certificate and "
                         "its key): %s is set, %s is empty" % (given, missing))
    roots = _read_certificates("tls_ca_file", tls_ca_file) if tls_ca_file else None
    chain = key = None
    if tls_cert_file:
        chain = _read_certificates("tls_cert_file", tls_cert_file)
        key = _read_private_key("tls_key_file", tls_key_file)
    return grpc.ssl_channel_credentials(roots, key, chain)


class Client:
    """A connection to one server. `tls_ca_file` (and for mutual TLS
    `tls_cert_file`, `tls_key_file`) turn TLS on; `token` is sent as a bearer
    token on every call. Message limits follow the server's GetServerInfo."""

    def __init__(self, target, tls_ca_file=None, tls_cert_file=None, tls_key_file=None,
                 token=None, timeout=30.0):
        _check_target(target)
        for field, path in (("tls_ca_file", tls_ca_file), ("tls_cert_file", tls_cert_file),
                            ("tls_key_file", tls_key_file)):
            _check_path(field, path)
        self._target = target
        self._timeout = timeout
        if token and not (tls_ca_file or tls_cert_file or tls_key_file):
            # As the C++ client and the CLI: a bearer token is never sent in
            # the clear.
            raise ValueError("token needs TLS: give tls_ca_file (the server's CA) as well")
        if token:
            _check_token(token)
        self._metadata = (("authorization", "Bearer " + token),) if token else ()
        self._credentials = None
        if tls_ca_file or tls_cert_file or tls_key_file:
            self._credentials = _ssl_credentials(tls_ca_file, tls_cert_file, tls_key_file)
        self._connect(4 << 20)
        try:
            limit = int(self.info().max_message_bytes) or (256 << 20)
            self._channel.close()
            self._connect(limit)
        except BaseException:
            # The error's traceback keeps this object, and an open channel
            # kept the target's connection in reconnect backoff: later
            # Client()s to it waited seconds (1 s, 1.6 s, ...) to fail or connect.
            self._channel.close()
            raise

    def _connect(self, limit):
        options = [("grpc.max_receive_message_length", limit),
                   ("grpc.max_send_message_length", limit)]
        if self._credentials is not None:
            self._channel = grpc.secure_channel(self._target, self._credentials, options)
        else:
            self._channel = grpc.insecure_channel(self._target, options)
        self._stub = pb_grpc.AttentionServiceStub(self._channel)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request):
        return method(request, timeout=self._timeout, metadata=self._metadata)

    def info(self):
        return self._call(self._stub.GetServerInfo, pb.GetServerInfoRequest())

    def health(self):
        """True when the server's health service says SERVING."""
        check = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
            response_deserializer=lambda b: b)
        return check(b"", timeout=self._timeout) == b"\x08\x01"

    def attend(self, q, k, v, *, kv_heads=0, causal=False, window=0, softcap=0.0, scale=0.0,
               rope=None, alibi=False, q_offsets=None, key_lengths=None, dtype="f32",
               out_dtype="f32"):
        """Attention of q [B, Sq, H, D] over k, v [B, Sk, Hkv, D]: out [B, Sq, H, Dv]."""
        q = _real_array(q, "q", "[batch, q_len, heads, head_dim]")
        k = _real_array(k, "k", "[batch, k_len, kv_heads, head_dim]")
        v = _real_array(v, "v", "[batch, k_len, kv_heads, v_dim]")
        spec = pb.AttentionSpec(heads=q.shape[2],
                                kv_heads=_int(kv_heads, "kv_heads") or k.shape[2],
                                head_dim=q.shape[3], causal=causal,
                                window=_int(window, "window"),
                                softcap=softcap, scale=scale)
        _set_positional(spec, rope, alibi)
        request = pb.AttendRequest(spec=spec, q=to_tensor(q, dtype), k=to_tensor(k, dtype),
                                   v=to_tensor(v, dtype), q_offsets=_ints(q_offsets, "q_offsets"),
                                   key_lengths=_ints(key_lengths, "key_lengths"),
                                   out_dtype=_dtype("out_dtype", out_dtype, _DTYPES))
        return from_tensor(self._call(self._stub.Attend, request).out)

    def rope_apply(self, x, *, rope=None, positions=None, offsets=None, inverse=False,
                   dtype="f32"):
        """x [B, S, H, D] rotated by RoPE (the default rule, theta 10000, when
        `rope` is None) at 0..S-1, per-row `offsets` or per-token `positions`."""
        x = _real_array(x, "x", "[batch, seq, heads, head_dim]")
        rope = _rope_spec({} if rope is None else rope)
        op = pb.EncodeRequest.RopeApply(rope=rope, x=to_tensor(x, dtype),
                                        positions=_ints(positions, "positions"),
                                        offsets=_ints(offsets, "offsets"),
                                        inverse=inverse)
        return from_tensor(self._call(self._stub.Encode, pb.EncodeRequest(rope_apply=op)).x)

    def embed(self, model, token_ids):
        """Embeddings [B, S, hidden] of a served model for ids [B, S] (or [S])."""
        ids = _int_array(token_ids, "token_ids")
        if ids.ndim not in (1, 2):
            raise ValueError("token_ids must be [S] or [B, S], got shape %s" % (ids.shape,))
        request = pb.EmbedRequest(model=model, token_ids=[int(x) for x in ids.reshape(-1)],
                                  shape=list(ids.shape) if ids.ndim == 2 else [])
        return from_tensor(self._call(self._stub.Embed, request).embeddings)

    def session(self, *, heads, head_dim, kv_heads=0, max_context=0, rope=None, alibi=False,
                window=0, kv_dtype="f32", start_position=0):
        """A decoding session (a context manager): step, truncate, fork,
        export_kv, close."""
        spec = pb.AttentionSpec(heads=_int(heads, "heads"), kv_heads=_int(kv_heads, "kv_heads"),
                                head_dim=_int(head_dim, "head_dim"), window=_int(window, "window"))
        _set_positional(spec, rope, alibi)
        return Session(self, pb.OpenSession(spec=spec, max_context=_int(max_context, "max_context"),
                                            kv_dtype=_dtype("kv_dtype", kv_dtype, _KV_DTYPES),
                                            start_position=_int(start_position,
                                                                "start_position")))


class _StreamDesync(grpc.RpcError):
    """A Decode answer whose seq is not the request's: the stream is ended,
    as a lost one, and this is its grpc.RpcError (code INTERNAL)."""

    def __init__(self, sent, answered):
        super().__init__("Decode answer has seq %d, the request %d: the stream is ended"
                         % (answered, sent))

    def code(self):
        return grpc.StatusCode.INTERNAL

    def details(self):
        return str(self)


def _end_stream(requests, call):
    """Ends a Decode stream from this side: grpcio's request-consumer thread
    waits in requests.get() until the None sentinel comes, whatever happened
    to the call, so a stream left without it keeps a thread forever. `call`
    holds the Decode call once Decode() has returned it (empty before)."""
    requests.put(None)
    for responses in call:
        responses.cancel()  # nothing once the call has ended


_CLOSED = "the session is closed: open another with Client.session()"


class Session:
    """One Decode stream holding one session. Answers come in order; an
    in-band error raises StepError and leaves the session usable; a failed
    open or a lost stream raises grpc.RpcError (so does an answer whose seq
    is not the request's: the stream is ended; an error with seq 0, the
    server's refusal of a message it could not read, is the request's
    in-band answer). An operation on a closed
    session raises ValueError (a second close() does nothing), as does one
    whose stream the server ended without answering it. An operation
    interrupted (KeyboardInterrupt, a signal handler's exception) before
    its request is on its way leaves the session as it was; from then on
    the interrupt ends the stream and closes the session before the
    exception goes on; never is a timeout left armed. A session may be
    shared between threads: its operations run one at a time, in the order
    they take its lock, each within the client's timeout (the wait for the
    lock included). A session dropped without close() ends its stream when
    it is collected."""

    def __init__(self, client, open_request):
        self._timeout = client._timeout
        # Taking the seq, sending and reading the answer are one step: two
        # threads inside one stream's next() broke grpcio's call.
        self._lock = threading.Lock()
        self._seq = 0
        self._requests = requests = queue.Queue()
        call = []
        # Every way out of the stream but a clean close() runs this (once): a
        # failed or interrupted open, a failed close, a lost stream, a
        # session collected unclosed. It is in place before Decode() starts
        # grpcio's request thread, so an interrupt anywhere after cannot leak it.
        self._end = weakref.finalize(self, _end_stream, requests, call)
        try:
            call.append(client._stub.Decode(iter(requests.get, None),
                                            metadata=client._metadata))
            self._responses = call[0]
            self.info = self._send(pb.DecodeRequest(open=open_request), "opened")
        except BaseException:
            self._end()
            raise

    def _locked(self):
        """Takes the session's lock within the client's timeout; else
        TimeoutError, nothing sent: another thread's operation holds it, and
        the session goes on (waiting out its time and then sending with a
        timer of 0 cancelled the stream, ending the session for every
        thread)."""
        if not self._lock.acquire(timeout=self._timeout):
            raise TimeoutError(
                "the session is busy with another thread's operation: waited the client's "
                "timeout of %g s for it; nothing was sent" % self._timeout)
        return time.monotonic() + self._timeout

    def _send(self, request, expect):
        """The answer to `request`: the open (seq 0) or an operation, whose
        seq is set here, the session's next."""
        deadline = self._locked()
        try:
            return self._exchange(request, expect, deadline)
        finally:
            self._lock.release()

    def _exchange(self, request, expect, deadline):
        """_send's work, under the session's lock."""
        if self._requests is None:
            # After close() (or a close that failed in a with block) the
            # stream is gone; ValueError, as grpc's own closed channel.
            raise ValueError(_CLOSED)
        requests, responses = self._requests, self._responses
        operation = request.WhichOneof("msg")
        seq = 0 if operation == "open" else self._seq + 1
        if seq:
            getattr(request, operation).seq = seq
        # Each operation has the client's timeout once it holds the lock:
        # past it the stream is cancelled (grpc.RpcError CANCELLED), as the
        # C++ client does.
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), responses.cancel)
        # Up to here an interrupt leaves the session as it was: nothing sent,
        # no timer, no seq taken.
        try:
            timer.start()  # waits for the timer's thread: signals run there
            requests.put(request)
            self._seq = seq
            response = next(responses)
            timer.cancel()  # here and in finally: an interrupt in one leaves the other
        except grpc.RpcError:
            self._end()  # the call is over (lost, cancelled, timed out)
            raise
        except StopIteration:
            # The server ended the stream (OK) without answering: the session
            # is gone there, and here it is the closed session.
            self._requests = None
            self._end()
            raise ValueError(_CLOSED) from None
        except BaseException:
            # Interrupted (KeyboardInterrupt, a signal handler's exception)
            # with the timer started: the request may be sent and its answer
            # would be read as the next operation's, so the stream ends here
            # and the session with it (a timer missed by an interrupt in
            # cancel() then cancels an ended call: nothing).
            self._requests = None
            self._end()
            raise
        finally:
            timer.cancel()
        # An error with seq 0 is the in-band answer to this request (answers
        # come in order): the server refuses a message it could not read (its
        # parse did not fit the memory budget) without knowing its seq.
        unread_refusal = (response.seq == 0 and response.WhichOneof("msg") == "error"
                          and response.error.seq == 0)
        if response.seq != seq and not unread_refusal:
            # An answer to another request: every later one would be off too.
            self._end()
            raise _StreamDesync(seq, response.seq)
        if response.WhichOneof("msg") == "error":
            code = next((c for c in grpc.StatusCode if c.value[0] == response.error.code),
                        grpc.StatusCode.UNKNOWN)
            raise StepError(code, response.error.message)
        return getattr(response, expect)

    def step(self, q, k, v, dtype="f32"):
        """Appends tokens q [1, T, H, D], k, v [1, T, Hkv, D]: out [1, T, H, Dv]."""
        q = _real_array(q, "q", "[1, tokens, heads, head_dim]")
        k = _real_array(k, "k", "[1, tokens, kv_heads, head_dim]")
        v = _real_array(v, "v", "[1, tokens, kv_heads, v_dim]")
        step = pb.Step(q=to_tensor(q, dtype), k=to_tensor(k, dtype), v=to_tensor(v, dtype))
        return from_tensor(self._send(pb.DecodeRequest(step=step), "step").out)

    def truncate(self, position):
        position = _int(position, "position")  # before anything is sent
        return self._send(pb.DecodeRequest(truncate=pb.Truncate(position=position)), "truncated")

    def fork(self):
        return self._send(pb.DecodeRequest(fork=pb.Fork()), "forked")

    def export_kv(self):
        """(keys, values) as float32 arrays [1, T, Hkv, D]: keys rotated at
        their positions, or, under a dynamic or longrope rule, the raw keys
        the session keeps (KvExport.key_form RAW)."""
        e = self._send(pb.DecodeRequest(export_kv=pb.ExportKv()), "exported")
        return from_tensor(e.k), from_tensor(e.v)

    def close(self):
        """The session's last SessionInfo; None when it is closed already."""
        deadline = self._locked()
        try:
            if self._requests is None:
                return None
            info = self._exchange(pb.DecodeRequest(close=pb.Close()), "closed", deadline)
            # The server closed it: so is this object, before anything that
            # an interrupt can stop (draining the stream left it half-closed,
            # and every later call raised a bare StopIteration).
            requests, self._requests = self._requests, None
            try:
                requests.put(None)
                for _ in self._responses:
                    pass
            except BaseException:
                self._end()
                raise
            self._end.detach()
            return info
        finally:
            self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
            return
        # An exception is on its way out of the block: closing must not
        # replace it (the session may be gone already, or the stream broken).
        try:
            self.close()
        except Exception:  # whatever close() raises, the block's own exception goes on
            self._requests = None
            self._end()
