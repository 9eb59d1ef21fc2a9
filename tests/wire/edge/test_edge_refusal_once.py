"""A verifier the edge refuses at start-up is said once (the command's own line), not also in the log;
one it refuses later, at a request, is logged once for the operator."""

from __future__ import annotations

import logging

import pytest

from draftwire import wire
from draftwire.contract import Drafting
from edge_client.app import EdgeConfig, serve
from edge_client.trust import UntrustedVerifier
from tests.wire.edge.test_edge_guard import CHAT, edge, honest_info, post, run, verifier, vocab  # noqa: F401


def test_a_refused_verifier_is_said_once(vocab, caplog):  # noqa: F811
    proto = wire.model_info_to_proto(honest_info(vocab))
    proto.vocab_size = 4095

    async def go():
        async with verifier(proto) as v:
            with pytest.raises(UntrustedVerifier, match="4095 tokens"):
                await serve(EdgeConfig(v.address, drafting=Drafting.NONE), vocab, "127.0.0.1", 0)
        assert [r for r in caplog.records if "refusing the verifier" in r.getMessage()] == []
        async with edge(vocab, proto) as client:
            status, _, _ = await post(client, "/v1/chat/completions", CHAT)
            assert status == 502
        said = [r for r in caplog.records if "refusing the verifier" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.ERROR

    with caplog.at_level(logging.INFO, logger="edge_client"):
        run(go())
