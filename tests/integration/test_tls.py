"""Mutual TLS between every service of `upesi serve` (router, target, draft, an expert shard) and on the public port.

The test makes a throw-away CA and one service certificate (server + client use, SAN 127.0.0.1) with `cryptography`,
and a second CA that nobody trusts. The stack only comes up if every internal link (router -> target, target ->
draft, target -> expert shard, the launcher's health check) completes the mTLS handshake. Then: a client with a
certificate from the CA gets the same greedy tokens as the in-process engine; a client without a certificate, one
with a certificate from the other CA, and a plaintext client get UNAVAILABLE, on the public port and on the target's
internal port alike.
"""
from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from shared.sampling_params import SamplingParams
from shared.testing.pki import make_pki
from tests.conftest import Stack, free_port
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = "red green blue, red green blue, red green blue, red green"    # repeats: the n-gram draft proposes
TOKENS = 8


@pytest.fixture(scope="module")
def mtls_stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls")
    pki, other = make_pki(tmp, "ours"), make_pki(tmp, "other")
    target = free_port()
    s = Stack(tmp, ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]), "--tls-ca", str(pki["ca"]),
                    "--target-address", f"127.0.0.1:{target}", "--draft", "ngram",
                    "--draft-address", f"127.0.0.1:{free_port()}", "--draft-metrics-port", "0",
                    "--expert-shards", "1", "--expert-metrics-port", "0"])
    s.target = f"127.0.0.1:{target}"
    try:
        s.wait_ready()
        yield s, pki, other
    finally:
        assert s.stop() == 0, s.log.read_text()[-3000:]


def _creds(ca: Path, cert: Path | None = None, key: Path | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(ca.read_bytes(), key.read_bytes() if key else None,
                                        cert.read_bytes() if cert else None)


def _generate(channel: grpc.Channel) -> pb.GenerateResponse:
    return generation_pb2_grpc.GenerationStub(channel).Generate(
        pb.GenerateRequest(prompt=PROMPT, max_tokens=TOKENS, temperature=0), timeout=120)


def test_client_with_certificate_is_served(mtls_stack, engine):
    """Greedy tokens equal the in-process engine's, with the draft's proposals (target -> draft over mTLS) and the
    FFNs on the expert shard (target -> shard over mTLS)."""
    stack, pki, _ = mtls_stack
    from shared.tokenizer import Tokenizer
    ids = Tokenizer(engine.model_path).encode(PROMPT)
    want = engine.generate([ids], SamplingParams(temperature=0, max_tokens=TOKENS))[0][0]
    with grpc.secure_channel(stack.address, _creds(pki["ca"], pki["cert"], pki["key"])) as ch:
        for _ in range(4):     # the target skips a draft whose first answer came too late (cold start), for 5 s
            r = _generate(ch)
            assert list(r.choices[0].token_ids) == want
            if r.spec.draft_tokens:
                break
            time.sleep(5)
    assert r.spec.draft_tokens > 0, "no proposal came from the draft service over mTLS"


@pytest.mark.parametrize("client", ["no certificate", "other CA's certificate", "plaintext"])
def test_client_without_trusted_certificate_is_refused(mtls_stack, client):
    stack, pki, other = mtls_stack
    for address, call in [(stack.address, _generate),
                          (stack.target, lambda ch: target_pb2_grpc.TargetStub(ch).Info(target_pb2.InfoRequest(),
                                                                                        timeout=30))]:
        if client == "plaintext":
            ch = grpc.insecure_channel(address)
        elif client == "no certificate":
            ch = grpc.secure_channel(address, _creds(pki["ca"]))
        else:
            ch = grpc.secure_channel(address, _creds(pki["ca"], other["cert"], other["key"]))
        with ch, pytest.raises(grpc.RpcError) as e:
            call(ch)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, (address, e.value.details())
