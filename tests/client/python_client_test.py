"""The Python client (client/python) against a real server: numpy in and out
(bf16 included), Attend, Encode, Embed, a decode session, message limits
from GetServerInfo, in-band errors, and the README's example script.
Numerics against plain numpy fp64 references; tolerances stated per check.
Run by ctest with PYTHONPATH at the generated package and ROPEATTN_SERVER at
the server binary."""

import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
from unittest import mock
import sys
import tempfile
import threading
import time
import unittest
import urllib.request

import grpc
import numpy as np

import ropeattn
from ropeattn.v1 import attention_pb2 as pb

SERVER = os.environ["ROPEATTN_SERVER"]
EXAMPLE = os.environ["ROPEATTN_EXAMPLE"]


def rel_err(got, want):
    return np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30)


def ref_rope(x, positions, theta=10000.0):
    """Half-split RoPE in fp64: x [B, S, H, D], positions [S]."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d // 2, dtype=np.float64) * 2.0 / d)
    ang = np.asarray(positions, np.float64)[:, None] * inv[None, :]  # [S, d/2]
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]
    a, b = x[..., : d // 2].astype(np.float64), x[..., d // 2 :].astype(np.float64)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def ref_attention(q, k, v, causal, q_offset):
    """Softmax attention in fp64: q [1, Sq, H, D], k/v [1, Sk, Hkv, *]."""
    _, sq, h, d = q.shape
    hkv = k.shape[2]
    out = np.zeros((1, sq, h, v.shape[3]))
    for head in range(h):
        g = head // (h // hkv)
        s = (q[0, :, head, :].astype(np.float64) @ k[0, :, g, :].T.astype(np.float64)) / np.sqrt(d)
        if causal:
            for i in range(sq):
                s[i, q_offset + i + 1 :] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[0, :, head, :] = p @ v[0, :, g, :].astype(np.float64)
    return out


class PythonClientTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.proc = subprocess.Popen([SERVER, "--address=127.0.0.1:0",
                                     "--metrics_address=127.0.0.1:0"],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        port = 0
        for line in cls.proc.stdout:  # JSON log lines; "listening" has the port
            event = json.loads(line)
            if event["event"] == "listening":
                port = event["port"]
                cls.metrics_url = event["metrics"]
                break
        # Keep reading the log so the server never blocks on a full pipe.
        threading.Thread(target=lambda: cls.proc.stdout.read(), daemon=True).start()
        cls.target = f"127.0.0.1:{port}"
        cls.client = ropeattn.Client(cls.target)
        cls.rng = np.random.default_rng(7)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.proc.terminate()
        cls.proc.wait(timeout=30)

    def test_health_and_limits_from_server_info(self):
        self.assertTrue(self.client.health())
        info = self.client.info()
        self.assertGreater(info.max_message_bytes, 8 << 20)
        # An 8 MiB answer (grpcio's stock receive limit is 4 MiB): the
        # client took its limit from GetServerInfo.
        q = np.ones((1, 2048, 8, 128), np.float32)
        k = np.ones((1, 1, 8, 128), np.float32)
        out = self.client.attend(q, k, k)
        self.assertEqual(out.shape, (1, 2048, 8, 128))
        self.assertTrue(np.allclose(out, 1.0))

    def test_rope_apply_matches_fp64(self):  # 1e-5 relative, f32
        x = self.rng.standard_normal((1, 9, 4, 32), dtype=np.float32)
        y = self.client.rope_apply(x, offsets=[1000])
        self.assertLess(rel_err(y, ref_rope(x, np.arange(1000, 1009))), 1e-5)
        back = self.client.rope_apply(y, offsets=[1000], inverse=True)
        self.assertLess(rel_err(back, x), 1e-5)

    def test_attend_f32_and_bf16(self):
        q = self.rng.standard_normal((1, 5, 4, 16), dtype=np.float32)
        k = self.rng.standard_normal((1, 7, 2, 16), dtype=np.float32)
        v = self.rng.standard_normal((1, 7, 2, 16), dtype=np.float32)
        want = ref_attention(q, k, v, causal=True, q_offset=2)
        got = self.client.attend(q, k, v, causal=True)
        self.assertLess(rel_err(got, want), 1e-5)  # f32: 1e-5
        got16 = self.client.attend(q, k, v, causal=True, dtype="bf16", out_dtype="bf16")
        self.assertEqual(got16.dtype, np.float32)
        self.assertLess(rel_err(got16, want), 1e-2)  # bf16: 1e-2
        self.assertGreater(rel_err(got16, want), 0)  # really rounded

    def test_bf16_conversion_rounds_to_nearest_even(self):
        x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e38], np.float32)
        t = ropeattn.to_tensor(x, "bf16")
        back = ropeattn.from_tensor(t)
        self.assertEqual(back.tolist(), [1.0, 1.0, 1.015625, -2.5, back[4]])
        self.assertTrue(np.isfinite(back[4]))

    def test_bf16_conversion_keeps_nan_a_nan(self):
        # NaNs whose payload is only in the low 16 bits used to round to Inf.
        bits = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x7F80FFFF], np.uint32)
        back = ropeattn.from_tensor(ropeattn.to_tensor(bits.view(np.float32), "bf16"))
        self.assertTrue(np.isnan(back).all(), back)
        self.assertEqual(np.signbit(back).tolist(), [False, True, False, False])

    def test_embed(self):
        e = self.client.embed("demo", [[1, 2, 3]])
        self.assertEqual(e.shape, (1, 3, 128))
        self.assertEqual(self.client.embed("demo", [1, 2]).shape, (1, 2, 128))
        with self.assertRaises(ValueError):  # was flattened into one row
            self.client.embed("demo", [[[1, 2]], [[3, 4]]])
        with self.assertRaises(TypeError) as e:  # was truncated to ids [1, 2]
            self.client.embed("demo", [1.7, 2.2])
        self.assertIn("token_ids", str(e.exception))
        self.assertEqual(self.client.embed("demo", np.array([1, 2], np.int32)).shape, (1, 2, 128))

    def test_an_unknown_dtype_is_a_value_error_naming_the_argument(self):
        x = np.ones((1, 1, 2, 8), np.float32)
        # Each was a bare KeyError from a dict lookup.
        for name, accepted, call in [
                ("kv_dtype", "f32, bf16 or int8",
                 lambda: self.client.session(heads=2, head_dim=8, kv_dtype="int4")),
                ("dtype", "f32 or bf16", lambda: self.client.attend(x, x, x, dtype="int8")),
                ("out_dtype", "f32 or bf16",
                 lambda: self.client.attend(x, x, x, out_dtype="f16")),
                ("dtype", "f32 or bf16", lambda: self.client.rope_apply(x, dtype="f64")),
                ("dtype", "f32 or bf16", lambda: ropeattn.to_tensor(x, ["bf16"]))]:
            with self.assertRaises(ValueError) as e:
                call()
            self.assertIn(name + " must be " + accepted, str(e.exception))
        with self.client.session(heads=2, head_dim=8) as s:
            with self.assertRaises(ValueError) as e:
                s.step(x, x, x, dtype="int8")
            self.assertIn("dtype must be f32 or bf16", str(e.exception))
            self.assertEqual(s.step(x, x, x).shape, (1, 1, 2, 8))  # the session goes on

    def test_an_operation_after_close_says_the_session_is_closed(self):
        x = np.ones((1, 1, 2, 8), np.float32)
        s = self.client.session(heads=2, head_dim=8)
        s.step(x, x, x)
        self.assertIsNotNone(s.close())
        # Each was AttributeError: 'NoneType' object has no attribute 'put'.
        for op in (lambda: s.step(x, x, x), lambda: s.truncate(0), s.fork, s.export_kv):
            with self.assertRaises(ValueError) as e:
                op()
            self.assertIn("session is closed", str(e.exception))
        self.assertIsNone(s.close())  # a second close is still nothing

    def test_array_arguments_refuse_what_they_would_cast_naming_the_argument(self):
        q = self.rng.standard_normal((1, 3, 2, 8), dtype=np.float32)
        with self.client.session(heads=2, head_dim=8) as s:
            step = s.step
            for name, kind, call in [
                    # A complex array was cast to its real part and computed on.
                    ("q", "complex", lambda: self.client.attend(q + 1j * q, q, q)),
                    ("v", "complex64", lambda: self.client.attend(q, q, q.astype(np.complex64))),
                    ("x", "complex", lambda: self.client.rope_apply(q * (1 + 2j))),
                    ("k", "complex", lambda: step(q[:, :1], q[:, :1] * 1j, q[:, :1])),
                    ("array", "complex", lambda: ropeattn.to_tensor(q * 1j)),
                    ("q", "bool", lambda: self.client.attend(q > 0, q, q)),
                    ("x", "<U1", lambda: self.client.rope_apply([[[["a"]]]])),
                    ("k", "object", lambda: self.client.attend(q, q.astype(object), q))]:
                with self.assertRaises(TypeError, msg=name) as e:
                    call()
                self.assertIn("%s must be an array of real numbers (integer or float), got %s"
                              % (name, kind), str(e.exception))
            for name, want, call in [
                    # A 3-D q was an IndexError naming nothing.
                    ("q", "q must be 4-D [batch, q_len, heads, head_dim], got shape (3, 2, 8)",
                     lambda: self.client.attend(q[0], q, q)),
                    ("v", "v must be 4-D [batch, k_len, kv_heads, v_dim], got shape (1, 3, 2, 8, 1)",
                     lambda: self.client.attend(q, q, q[..., None])),
                    ("x", "x must be 4-D [batch, seq, heads, head_dim], got shape (3, 2, 8)",
                     lambda: self.client.rope_apply(q[0])),
                    ("q", "q must be 4-D [1, tokens, heads, head_dim], got shape (1, 2, 8)",
                     lambda: step(q[0, :1], q[:, :1], q[:, :1])),
                    ("q", "q must be a rectangular array", lambda: self.client.attend(
                        [[[[1.0]]], [[[1.0, 2.0]]]], q, q))]:
                with self.assertRaises(ValueError, msg=name) as e:
                    call()
                self.assertIn(want, str(e.exception))
            # No seq was spent on a refused step: the session goes on.
            self.assertEqual(step(q[:, :1], q[:, :1], q[:, :1]).shape, (1, 1, 2, 8))
        # Nested lists (attend raised AttributeError on them) and integer or
        # float64 arrays are taken as they are.
        want = self.client.attend(q, q, q)
        self.assertTrue(np.array_equal(self.client.attend(q.tolist(), q.tolist(), q.tolist()),
                                       want))
        self.assertTrue(np.array_equal(self.client.attend(q.astype(np.float64), q, q), want))
        ones = np.ones((1, 2, 2, 8), np.int64)
        self.assertTrue(np.array_equal(self.client.rope_apply(ones),
                                       self.client.rope_apply(ones.astype(np.float32))))

    def test_numpy_offsets_and_positions(self):
        q = self.rng.standard_normal((2, 3, 2, 8), dtype=np.float32)
        k = self.rng.standard_normal((2, 5, 2, 8), dtype=np.float32)
        got = self.client.attend(q, k, k, causal=True, q_offsets=np.array([1, 2]))
        for b, off in ((0, 1), (1, 2)):
            want = ref_attention(q[b:b + 1], k[b:b + 1], k[b:b + 1], causal=True, q_offset=off)
            self.assertLess(rel_err(got[b:b + 1], want), 1e-5)
        x = self.rng.standard_normal((1, 3, 2, 8), dtype=np.float32)
        y = self.client.rope_apply(x, positions=np.array([5, 9, 2]))
        self.assertLess(rel_err(y, ref_rope(x, np.array([5, 9, 2]))), 1e-5)
        with self.assertRaises(TypeError) as e:  # a fractional offset is not truncated
            self.client.attend(q, k, k, q_offsets=[1.7, 2.0])
        self.assertIn("q_offsets", str(e.exception))

    def test_integer_arguments_refuse_floats_naming_the_argument(self):
        # Each was protobuf's own TypeError, naming no argument.
        for name, call in [
                ("start_position", lambda: self.client.session(heads=2, head_dim=8,
                                                               start_position=2.5)),
                ("max_context", lambda: self.client.session(heads=2, head_dim=8,
                                                            max_context=8.0)),
                ("heads", lambda: self.client.session(heads=2.0, head_dim=8)),
                ("window", lambda: self.client.session(heads=2, head_dim=8, window=1.5))]:
            with self.assertRaises(TypeError) as e:
                call()
            self.assertIn(name, str(e.exception))
        x = np.ones((1, 1, 2, 8), np.float32)
        with self.client.session(heads=2, head_dim=8, start_position=np.int64(3)) as s:
            s.step(x, x, x)
            with self.assertRaises(TypeError) as e:
                s.truncate(1.0)
            self.assertIn("position", str(e.exception))
            self.assertEqual(s.truncate(0).position, 0)  # no seq was spent on the refusal
        # A bool among integers: numpy made [True, 2] the integers [1, 2]
        # (and _int refuses a bool alone).
        q = np.ones((2, 1, 2, 8), np.float32)
        for name, call in [
                ("q_offsets", lambda: self.client.attend(q, q, q, q_offsets=[1, True])),
                ("key_lengths", lambda: self.client.attend(q, q, q, key_lengths=[np.True_, 1])),
                ("positions", lambda: self.client.rope_apply(np.ones((1, 2, 2, 8), np.float32),
                                                             positions=[0, True])),
                ("offsets", lambda: self.client.rope_apply(q, offsets=(np.int64(0), False))),
                ("token_ids", lambda: self.client.embed("any", [[1, 2], [3, True]]))]:
            with self.assertRaises(TypeError, msg=name) as e:
                call()
            self.assertIn("%s must be integers, got" % name, str(e.exception))
            self.assertIn("(a bool)", str(e.exception))
        with self.assertRaises(TypeError) as e:  # bools alone were refused already
            self.client.rope_apply(q[:1], positions=[True])
        self.assertIn("positions must be integers, got bool", str(e.exception))

    def test_integers_outside_int64_are_refused_naming_the_argument(self):
        # Each was protobuf's bare "Value out of range" ([2**63, 0] was
        # "q_offsets must be integers, got float64").
        q = np.ones((2, 1, 2, 8), np.float32)
        x = np.ones((1, 3, 2, 8), np.float32)
        for name, value, call in [
                ("q_offsets", 2**63, lambda: self.client.attend(q, q, q, q_offsets=[2**63, 0])),
                ("key_lengths", -2**63 - 1,
                 lambda: self.client.attend(q, q, q, key_lengths=[1, -2**63 - 1])),
                ("positions", 2**64, lambda: self.client.rope_apply(x, positions=[0, 1, 2**64])),
                ("offsets", 2**63,
                 lambda: self.client.rope_apply(x, offsets=np.array([2**63], np.uint64))),
                ("token_ids", 2**70, lambda: self.client.embed("any", [[1, 2**70]])),
                ("start_position", 2**63,
                 lambda: self.client.session(heads=2, head_dim=8, start_position=2**63))]:
            with self.assertRaises(ValueError, msg=name) as e:
                call()
            self.assertIn("%s must be in int64's range -2**63..2**63-1, got %d" % (name, value),
                          str(e.exception))
        with self.client.session(heads=2, head_dim=8) as s:
            with self.assertRaises(ValueError) as e:
                s.truncate(-2**63 - 1)
            self.assertIn("position must be in int64's range", str(e.exception))
            self.assertEqual(s.truncate(0).position, 0)  # no seq was spent on the refusal
        # The range's ends are taken (and refused by the server, not here).
        with self.assertRaises(grpc.RpcError):
            self.client.rope_apply(x[:, :2], positions=[2**63 - 1, -2**63])

    def test_a_bad_rope_is_refused_naming_it(self):
        # Each was protobuf's ParseError, naming no argument.
        x = np.ones((1, 2, 2, 8), np.float32)
        for call in (lambda: self.client.attend(x, x, x, rope="default"),
                     lambda: self.client.rope_apply(x, rope="default"),
                     lambda: self.client.session(heads=2, head_dim=8, rope=[10000])):
            with self.assertRaises(TypeError) as e:
                call()
            self.assertIn("rope must be a dict of RopeSpec fields", str(e.exception))
        for want, call in [
                ('no field named "thetaa"', lambda: self.client.attend(x, x, x,
                                                                       rope={"thetaa": 1})),
                ("theta", lambda: self.client.rope_apply(x, rope={"theta": "x"})),
                ('no field named "kind"',
                 lambda: self.client.session(heads=2, head_dim=8, rope={"kind": "yarn"}))]:
            with self.assertRaises(ValueError) as e:
                call()
            self.assertTrue(str(e.exception).startswith("rope: "), str(e.exception))
            self.assertIn(want, str(e.exception))
        # A value protobuf parses is the server's to refuse: INVALID_ARGUMENT
        # naming the field.
        for field, rope in (("theta", {"theta": -1}),
                            ("rope_type", {"scaling": {"rope_type": "bogus"}})):
            with self.assertRaises(grpc.RpcError, msg=field) as e:
                self.client.rope_apply(x, rope=rope)
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn(field, e.exception.details())

    def test_rope_and_alibi_together_are_refused_naming_both(self):
        # AttentionSpec.positional is a oneof: ALiBi set after RoPE cleared it,
        # and the server computed ALiBi alone.
        x = np.ones((1, 2, 2, 8), np.float32)
        for call in (lambda: self.client.attend(x, x, x, rope={"theta": 10000}, alibi=True),
                     lambda: self.client.attend(x, x, x, rope={}, alibi=True),
                     lambda: self.client.session(heads=2, head_dim=8, rope={}, alibi=True)):
            with self.assertRaises(ValueError) as e:
                call()
            self.assertIn("rope and alibi are two positional schemes", str(e.exception))
        # Either alone still works.
        self.assertEqual(self.client.attend(x, x, x, alibi=True).shape, (1, 2, 2, 8))
        with self.client.session(heads=2, head_dim=8, rope={}) as s:
            self.assertTrue(s.info.spec.HasField("rope"))

    def test_a_target_gRPC_would_misdial_is_refused_naming_it(self):
        port = int(self.target.rsplit(":", 1)[1])
        wrapped = "127.0.0.1:%d" % (port + 65536)  # gRPC dialed the port modulo 65536
        for target, want in [
                (wrapped, 'target "%s": the port must be a number in 1..65535, got "%d"'
                 % (wrapped, port + 65536)),
                ("127.0.0.1:0", "the port must be a number in 1..65535"),
                ("127.0.0.1:", 'target "127.0.0.1:" has no port'),
                ("localhost", "has no port; give host:port, e.g. localhost:50051"),
                ("::1:50051", "write an IPv6 address in brackets"),
                ("[::1]x", 'has "x" after its IPv6 address'),
                ("http://127.0.0.1:50051", "is a URL"),
                ("dns:///127.0.0.1:99999", "the port must be a number in 1..65535"),
                ("ipv4:127.0.0.1:1,127.0.0.1:70000", 'address "127.0.0.1:70000"'),
                ("ipv6:127.0.0.1:1", "is not [IPv6 address]:port"),
                ("unix:", "has no socket path"),
                ("", "target must not be empty")]:
            with self.assertRaises(ValueError, msg=target) as e:
                ropeattn.Client(target, timeout=5)
            self.assertIn(want, str(e.exception))
        for target in ("dns:///" + self.target, "ipv4:" + self.target,
                       "ipv4:///" + self.target):
            with ropeattn.Client(target) as c:
                self.assertTrue(c.health(), target)

    def test_a_failed_client_closes_its_channel(self):
        # Client() whose GetServerInfo failed left its channel open (the
        # error's traceback keeps it), holding the target's connection in
        # reconnect backoff: each later Client() to it waited 1 s, 1.6 s, ...
        # Every channel it made is recorded, and must have been closed.
        with socket.socket() as sock:  # a port nothing listens on
            sock.bind(("127.0.0.1", 0))
            target = "127.0.0.1:%d" % sock.getsockname()[1]
        made = []
        real = grpc.insecure_channel

        def recording(address, options=None):
            channel = real(address, options)
            closed = []
            close = channel.close

            def recorded_close():
                closed.append(True)
                close()
            channel.close = recorded_close
            made.append(closed)
            return channel

        with mock.patch.object(grpc, "insecure_channel", recording):
            try:  # not assertRaises: it drops the traceback, and the channel with it
                ropeattn.Client(target, timeout=10)
                self.fail("Client() to %s with no server" % target)
            except grpc.RpcError as e:
                kept = e  # kept with its traceback, as a retry loop or a REPL does
        self.assertIsNotNone(kept)
        self.assertEqual(len(made), 1)
        self.assertTrue(made[0], "the failed Client()'s channel was not closed")

    def test_token_without_tls_is_refused(self):
        with self.assertRaises(ValueError) as e:
            ropeattn.Client(self.target, token="secret")
        self.assertIn("TLS", str(e.exception))

    def test_tls_files_are_checked_as_the_cpp_client_does(self):
        with tempfile.TemporaryDirectory() as d:
            subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                            "ec_paramgen_curve:prime256v1", "-nodes", "-days", "30", "-subj",
                            "/CN=test", "-keyout", d + "/client.key", "-out", d + "/client.pem"],
                           check=True, capture_output=True)
            with open(d + "/not.pem", "w") as f:
                f.write("not a certificate\n")
            # A certificate without its key (or the reverse) aborted the
            # interpreter in gRPC core: run in a child so a crash is a failure.
            for given, missing in (("tls_cert_file", "tls_key_file"),
                                   ("tls_key_file", "tls_cert_file")):
                path = d + ("/client.pem" if given == "tls_cert_file" else "/client.key")
                child = subprocess.run(
                    [sys.executable, "-c",
                     "import sys, ropeattn\n"
                     "try:\n"
                     "    ropeattn.Client(sys.argv[1], **{sys.argv[2]: sys.argv[3]})\n"
                     "except ValueError as e:\n"
                     "    print(e)\n", self.target, given, path],
                    capture_output=True, text=True, timeout=60)
                self.assertEqual(child.returncode, 0, child.stderr)
                self.assertIn("tls_cert_file and tls_key_file go together", child.stdout)
                self.assertIn("%s is set, %s is empty" % (given, missing), child.stdout)
            for kwargs, want in [
                    ({"tls_ca_file": d + "/missing.pem"},
                     'tls_ca_file "%s/missing.pem" cannot be read: No such file' % d),
                    ({"tls_ca_file": d}, 'tls_ca_file "%s" cannot be read: Is a directory' % d),
                    ({"tls_ca_file": d + "/not.pem"},
                     'tls_ca_file "%s/not.pem" holds no PEM certificate' % d),
                    ({"tls_cert_file": d + "/client.key", "tls_key_file": d + "/client.key"},
                     'tls_cert_file "%s/client.key" holds no PEM certificate' % d),
                    ({"tls_cert_file": d + "/client.pem", "tls_key_file": d + "/not.pem"},
                     'tls_key_file "%s/not.pem" holds no PEM private key' % d),
                    ({"tls_cert_file": d + "/client.pem", "tls_key_file": d + "/missing.key"},
                     'tls_key_file "%s/missing.key" cannot be read' % d)]:
                with self.assertRaises(ValueError) as e:
                    ropeattn.Client(self.target, **kwargs)
                self.assertIn(want, str(e.exception))

    def test_a_tls_file_that_is_not_a_path_is_refused_touching_no_fd(self):
        # open() takes an int as a file descriptor: tls_ca_file=3 read the
        # caller's fd 3 and closed it (tls_cert_file=True: fd 1, stdout).
        for field in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            r, w = os.pipe()
            os.write(w, b"not a pem")
            os.close(w)  # so a read of r ends (and the test fails rather than hangs)
            try:
                for value, kind in ((r, "int"), (False, "bool"), (2.5, "float")):
                    with self.assertRaises(TypeError, msg=field) as e:
                        ropeattn.Client(self.target, **{field: value})
                    self.assertIn("%s must be a path (str, bytes or os.PathLike), got %s"
                                  % (field, kind), str(e.exception))
                os.fstat(r)  # still open
                self.assertEqual(os.read(r, 100), b"not a pem")  # and unread
            finally:
                try:
                    os.close(r)
                except OSError:  # closed by the client
                    pass
        with tempfile.TemporaryDirectory() as d:  # bytes and os.PathLike are paths
            for path in (os.fsencode(d + "/missing.pem"), pathlib.Path(d, "missing.pem")):
                with self.assertRaises(ValueError) as e:
                    ropeattn.Client(self.target, tls_ca_file=path)
                self.assertIn("cannot be read: No such file", str(e.exception))

    def test_a_token_gRPC_cannot_send_is_refused_without_echoing_it(self):
        # As the C++ client: refused before any file is read or call made,
        # naming the position only (grpcio's error quotes the header).
        for token, where, hint in [("s3cr3t-value\n", "character 12 of 13", False),
                                   ("s3cr3t value", "character 6 of 12", False),
                                   ("Bearer s3cr3t", "character 6 of 13", True),
                                   ("s3cr\u00e9t", "character 4 of 7", False)]:
            with self.assertRaises(ValueError) as e:
                ropeattn.Client(self.target, tls_ca_file="/nonexistent/ca.pem", token=token)
            message = str(e.exception)
            self.assertIn("printable ASCII without spaces", message)
            self.assertIn(where, message)
            self.assertEqual("without \"Bearer \"" in message, hint)
            self.assertNotIn("s3cr", message)

    def test_an_exception_in_a_session_block_is_not_replaced(self):
        class Boom(Exception):
            pass
        with self.assertRaises(Boom):
            with self.client.session(heads=2, head_dim=8, max_context=8) as s:
                s._responses.cancel()  # the stream breaks, as a lost connection would
                raise Boom()  # close() then fails: it must not replace this

    def test_an_interrupted_operation_ends_the_session(self):
        # KeyboardInterrupt (or a signal handler's exception) while an answer
        # was pending left it in the stream: the next step returned the
        # interrupted step's output, and every later answer was one behind.
        class Interrupted:  # a next() interrupted once the request is sent
            def __init__(self, responses):
                self.responses = responses

            def __next__(self):
                raise KeyboardInterrupt()

            def cancel(self):
                self.responses.cancel()

        x = self.rng.standard_normal((1, 1, 2, 8), dtype=np.float32)
        s = self.client.session(heads=2, head_dim=8)
        s.step(x, x, x)
        responses = s._responses
        s._responses = Interrupted(responses)
        with self.assertRaises(KeyboardInterrupt):
            s.step(x, x, x)
        s._responses = responses
        for op in (lambda: s.step(x, x, x), s.export_kv):
            with self.assertRaises(ValueError) as e:
                op()
            self.assertIn("session is closed", str(e.exception))
        self.assertIsNone(s.close())
        # An answer whose seq is not the request's ends the stream as a lost
        # one (here a request the session did not send answers first).
        s = self.client.session(heads=2, head_dim=8)
        s.step(x, x, x)
        s._requests.put(pb.DecodeRequest(export_kv=pb.ExportKv(seq=1000)))
        with self.assertRaises(grpc.RpcError) as e:
            s.truncate(0)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INTERNAL)
        self.assertIn("Decode answer has seq 1000, the request 2", str(e.exception))
        with self.assertRaises(grpc.RpcError):
            s.step(x, x, x)

    def test_the_refusal_of_an_unread_message_is_its_requests_in_band_answer(self):
        # A message whose parse the server's memory budget cannot hold is
        # refused in band with seq 0 (the server never read its seq) and the
        # stream stays open: the seq check took it for a desync, ending the
        # stream and the session.
        proc = subprocess.Popen([SERVER, "--address=127.0.0.1:0",
                                 "--memory_budget_bytes=1048576"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            port = 0
            for line in proc.stdout:
                event = json.loads(line)
                if event["event"] == "listening":
                    port = event["port"]
                    break
            threading.Thread(target=lambda: proc.stdout.read(), daemon=True).start()
            client = ropeattn.Client(f"127.0.0.1:{port}")
            try:
                s = client.session(heads=2, head_dim=8, max_context=8)
                x = self.rng.standard_normal((1, 1, 2, 8), dtype=np.float32)
                t = ropeattn.to_tensor(x, "f32")
                step = pb.DecodeRequest(step=pb.Step(q=t, k=t, v=t))
                # ~600 KB of an unknown varint field (number 1000), an entry
                # each in memory: past the 1 MiB budget once parsed.
                padded = pb.DecodeRequest.FromString(
                    step.SerializeToString() + b"\xc0\x3e\x00" * 200000)
                with self.assertRaises(ropeattn.StepError) as e:
                    s._send(padded, "step")
                self.assertEqual(e.exception.code, grpc.StatusCode.RESOURCE_EXHAUSTED)
                self.assertIn("parsing this ropeattn.v1.DecodeRequest", e.exception.message)
                self.assertEqual(s.step(x, x, x).shape, (1, 1, 2, 8))  # the session went on
                s.close()
            finally:
                client.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    def test_an_interrupt_leaves_no_timer_armed(self):
        # timer.start() ran before the try (and waits for the timer's thread,
        # where signals run): an interrupt there left the session open with
        # its timer armed, and `timeout` seconds later it cancelled the stream
        # under another step. An interrupt in the finally's cancel() alike.
        timers = []

        class InterruptedStart(threading.Timer):
            def start(self):
                timers.append(self)
                super().start()
                raise KeyboardInterrupt()

        class InterruptedCancel(threading.Timer):
            interrupted = False

            def cancel(self):
                timers.append(self)
                if not InterruptedCancel.interrupted:
                    InterruptedCancel.interrupted = True
                    raise KeyboardInterrupt()
                super().cancel()

        x = np.ones((1, 1, 2, 8), np.float32)
        for name, timer in (("start", InterruptedStart), ("cancel", InterruptedCancel)):
            timers.clear()
            s = self.client.session(heads=2, head_dim=8)
            s.step(x, x, x)
            with mock.patch("threading.Timer", timer):
                with self.assertRaises(KeyboardInterrupt, msg=name):
                    s.step(x, x, x)
            self.assertTrue(timers, name)
            for t in timers:
                self.assertTrue(t.finished.is_set(), name)
                t.join(10)
                self.assertFalse(t.is_alive(), name)
            with self.assertRaises(ValueError, msg=name) as e:  # ended, not left to a timer
                s.step(x, x, x)
            self.assertIn("session is closed", str(e.exception))
        # An interrupt before the timer starts leaves the session as it was:
        # nothing sent, no seq taken.
        s = self.client.session(heads=2, head_dim=8)
        s.step(x, x, x)
        with mock.patch("threading.Timer", side_effect=KeyboardInterrupt):
            with self.assertRaises(KeyboardInterrupt):
                s.step(x, x, x)
        self.assertEqual(s.step(x, x, x).shape, (1, 1, 2, 8))
        self.assertEqual(s.close().position, 2)

    @staticmethod
    def request_threads():
        """grpcio's request-consumer threads (one per Decode call still reading
        its requests)."""
        n = 0
        for frame in sys._current_frames().values():
            while frame is not None and frame.f_code.co_name != "consume_request_iterator":
                frame = frame.f_back
            n += frame is not None
        return n

    def test_an_interrupted_open_ends_its_stream(self):
        # The open's try began after Decode() had started grpcio's request
        # thread and after the finalizer was made: an interrupt in between
        # left that thread waiting on the queue for good.
        class InterruptedDecode:
            def __init__(self, stub):
                self.stub = stub

            def Decode(self, *args, **kwargs):
                self.stub.Decode(*args, **kwargs)
                raise KeyboardInterrupt()  # the call is made, never returned

        client = ropeattn.Client(self.target)
        try:
            before = self.request_threads()
            client._stub = InterruptedDecode(client._stub)
            with self.assertRaises(KeyboardInterrupt):
                client.session(heads=2, head_dim=8)
            deadline = time.monotonic() + 10
            while self.request_threads() > before and time.monotonic() < deadline:
                time.sleep(0.05)
            self.assertEqual(self.request_threads(), before)
        finally:
            client.close()

    def test_an_interrupted_close_leaves_the_session_closed(self):
        # An interrupt while close() drained the ended stream (the server had
        # answered `closed`) left the session half-closed: a second close()
        # and every operation raised a bare StopIteration, and a map() over
        # steps silently ended empty.
        class DrainInterrupted:
            def __init__(self, responses):
                self.responses, self.calls = responses, 0

            def __iter__(self):
                return self

            def __next__(self):
                self.calls += 1
                if self.calls == 2:  # the first is the close's answer
                    raise KeyboardInterrupt()
                return next(self.responses)

            def cancel(self):
                self.responses.cancel()

        x = np.ones((1, 1, 2, 8), np.float32)
        s = self.client.session(heads=2, head_dim=8)
        s.step(x, x, x)
        s._responses = DrainInterrupted(s._responses)
        with self.assertRaises(KeyboardInterrupt):
            s.close()
        self.assertIsNone(s.close())
        for op in (lambda: s.step(x, x, x), s.fork,
                   lambda: list(map(lambda i: s.step(x, x, x), range(3)))):
            with self.assertRaises(ValueError) as e:
                op()
            self.assertIn("session is closed", str(e.exception))

        # A stream the server ended (OK) under an operation, without its
        # answer, is the closed session, never a StopIteration.
        class Ended:
            def __next__(self):
                raise StopIteration

            def cancel(self):
                pass

        s = self.client.session(heads=2, head_dim=8)
        s._responses = Ended()
        with self.assertRaises(ValueError) as e:
            s.step(x, x, x)
        self.assertIn("session is closed", str(e.exception))
        self.assertIsNone(s.close())

    def test_a_session_is_shared_between_threads_one_operation_at_a_time(self):
        # Several threads stepping one session ran inside one stream's next()
        # together (grpcio: "Internal gRPC call error 8", steps blocked past
        # their timeout) and one could find _requests None after the check.
        class Overlap:  # next() held a little, counting who is inside
            def __init__(self, responses):
                self.responses, self.lock = responses, threading.Lock()
                self.inside = self.most = 0

            def __iter__(self):
                return self

            def __next__(self):
                with self.lock:
                    self.inside += 1
                    self.most = max(self.most, self.inside)
                try:
                    time.sleep(0.005)
                    return next(self.responses)
                finally:
                    with self.lock:
                        self.inside -= 1

            def cancel(self):
                self.responses.cancel()

        x = np.ones((1, 1, 2, 8), np.float32)
        s = self.client.session(heads=2, head_dim=8, max_context=64)
        s._responses = overlap = Overlap(s._responses)
        errors = []

        def steps():
            try:
                for _ in range(10):
                    self.assertEqual(s.step(x, x, x).shape, (1, 1, 2, 8))
            except BaseException as e:  # noqa: B902, reported below
                errors.append(e)

        threads = [threading.Thread(target=steps) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertFalse(any(t.is_alive() for t in threads))
        self.assertEqual(errors, [])
        self.assertEqual(overlap.most, 1)
        self.assertEqual(s.close().position, 30)

    def test_a_thread_that_waits_out_its_timeout_for_the_lock_sends_nothing(self):
        # A thread that waited its whole timeout for another thread's
        # operation then sent with a timer of 0, which cancelled the stream:
        # the session ended for every thread though no operation was slow.
        with ropeattn.Client(self.target, timeout=1) as c:
            s = c.session(heads=2, head_dim=8)
            x = np.ones((1, 1, 2, 8), np.float32)
            s.step(x, x, x)
            held = threading.Event()
            release = threading.Event()

            def hold():
                with s._lock:
                    held.set()
                    release.wait(10)
            t = threading.Thread(target=hold)
            t.start()
            held.wait(10)
            try:
                with self.assertRaises(TimeoutError) as e:
                    s.step(x, x, x)
                self.assertIn("nothing was sent", str(e.exception))
            finally:
                release.set()
                t.join(10)
            self.assertEqual(s.step(x, x, x).shape, (1, 1, 2, 8))  # the session went on
            self.assertEqual(s.close().position, 2)

    def test_an_abandoned_stream_leaves_no_thread(self):
        # grpcio's request-consumer thread waits on the session's queue until
        # the end sentinel: a failed open, a failed close in a with block and a
        # session dropped unclosed left one blocked forever each.
        def threads_after(action, n=20):
            before = threading.active_count()
            for _ in range(n):
                action()
            deadline = time.monotonic() + 10
            while threading.active_count() > before + 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            return threading.active_count() - before

        def failed_open():
            with self.assertRaises(grpc.RpcError):
                self.client.session(heads=0, head_dim=8)  # INVALID_ARGUMENT at open

        def failed_close():
            with self.assertRaises(KeyError):
                with self.client.session(heads=2, head_dim=8) as s:
                    # Closed by another caller: close() then fails
                    # (FAILED_PRECONDITION ends the stream).
                    self.client._stub.CloseSession(
                        pb.CloseSessionRequest(session_id=s.info.session_id))
                    raise KeyError()

        x = np.ones((1, 1, 2, 8), np.float32)

        def dropped():
            s = self.client.session(heads=2, head_dim=8)
            s.step(x, x, x)
            del s

        for name, action in (("failed open", failed_open), ("failed close", failed_close),
                             ("dropped session", dropped)):
            self.assertLessEqual(threads_after(action), 2, name)

    def test_session_steps_match_attention_over_the_prefix(self):  # 1e-5
        q = self.rng.standard_normal((1, 6, 4, 16), dtype=np.float32)
        k = self.rng.standard_normal((1, 6, 2, 16), dtype=np.float32)
        v = self.rng.standard_normal((1, 6, 2, 16), dtype=np.float32)
        with self.client.session(heads=4, kv_heads=2, head_dim=16, max_context=16) as s:
            self.assertEqual(s.info.max_context, 16)
            for t in range(6):
                out = s.step(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1])
                want = ref_attention(q[:, t : t + 1], k[:, : t + 1], v[:, : t + 1], True, t)
                self.assertLess(rel_err(out, want), 1e-5)
            keys, values = s.export_kv()
            self.assertEqual(keys.shape, (1, 6, 2, 16))
            self.assertTrue(np.array_equal(values, v))
            with self.assertRaises(ropeattn.StepError) as e:
                s.step(q[:, :1], k[:, :1, :1], v[:, :1])  # one kv head short
            self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("step.k", e.exception.message)
            self.assertEqual(s.truncate(3).position, 3)  # the session went on

    def closed_sessions(self):
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        return {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^ropeattn_sessions_closed_total\{reason="(\w+)"\} (\S+)$', text, re.M)}

    def test_a_killed_client_counts_as_disconnected(self):
        # A client process killed while its session is idle: the server's read
        # fails before gRPC reports the call cancelled, and the session was
        # counted as a stream that ended normally (reason="stream_ended").
        before = self.closed_sessions()
        child = subprocess.Popen(
            [sys.executable, "-c",
             "import sys, time, ropeattn\n"
             "c = ropeattn.Client(sys.argv[1])\n"
             "s = c.session(heads=2, head_dim=8, max_context=8)\n"
             "s.__enter__()\n"
             "print('open', flush=True)\n"
             "time.sleep(120)\n", self.target],
            stdout=subprocess.PIPE, text=True)
        self.assertEqual(child.stdout.readline().strip(), "open")
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
        deadline = time.monotonic() + 10
        after = self.closed_sessions()
        while after.get("disconnected", 0) == before.get("disconnected", 0) and \
                time.monotonic() < deadline:
            time.sleep(0.05)
            after = self.closed_sessions()
        self.assertEqual(after.get("disconnected", 0), before.get("disconnected", 0) + 1)
        self.assertEqual(after.get("stream_ended", 0), before.get("stream_ended", 0))

    def test_errors_are_the_servers(self):
        with self.assertRaises(grpc.RpcError) as e:
            self.client.embed("no-such-model", [1])
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_readme_example_runs(self):
        # Run from elsewhere, as a user's script would be (beside the source
        # package, Python would import that copy, which has no stubs).
        with tempfile.TemporaryDirectory() as d:
            script = os.path.join(d, "example.py")
            shutil.copy(EXAMPLE, script)
            try:
                out = subprocess.run([sys.executable, script, self.target], capture_output=True,
                                     text=True, timeout=120)
            except subprocess.TimeoutExpired as e:
                self.fail("the example did not finish in 120 s; stdout %r, stderr %r"
                          % (e.stdout, e.stderr))
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("norms kept: True", out.stdout)
        self.assertIn("decode: 10 steps, last output (1, 1, 8, 64)", out.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
