"""`draftwire edge`, the device's HTTP app, against a real verifier: the official `openai` client (streaming
and not) gets exactly the target's text; stop strings, errors, disconnects and kept conversations behave as
the OpenAI API and llama-server users expect. Runs in CI's edge-only environment too (no torch).
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from openai import OpenAI

from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from edge_client.llama_runtime import Llama
from tools.rig.serverproc import EdgeProcess, ServerProcess

DEMO = Path(__file__).resolve().parents[3] / "models" / "demo"
DRAFT = DEMO / "draft-q8_0.gguf"
MODEL = "demo-target"  # the name the verifier serves models/demo/target under (its pair's name)
EDGE = str(Path(sys.executable).parent / "draftwire")
VERIFIER = os.environ.get("DRAFTWIRE_VERIFIER") or EDGE
PROMPT = "def sum_of_squares(values):\n"


@pytest.fixture(scope="module")
def verifier():
    with ServerProcess(DEMO / "target", executable=VERIFIER) as server:
        yield server


@pytest.fixture(scope="module")
def edge(verifier, tmp_path_factory):
    """One app for the module's requests, at a fixed γ and depth: its tests read speculative rounds (their
    figures, the verifier's γ cap, one verifier session per reply), and whether speculation pays for the
    demo pair is a matter of timing, so an adaptive app's tuner, which outlives a request, may hand later
    replies to the verifier (CI saw it). The adaptive default and its fallback: tests/exact/edge."""
    db = tmp_path_factory.mktemp("edge") / "edge.sqlite3"
    fixed = ("--gamma", "4", "--pipeline", "1")
    with EdgeProcess(verifier.address, DRAFT, *fixed, db=db, executable=EDGE) as app:
        yield app


@pytest.fixture(scope="module")
def client(edge):
    return OpenAI(base_url=edge.url + "v1", api_key="unused")


@pytest.fixture(scope="module")
def vocab():
    return Llama(model_path=str(DRAFT), vocab_only=True, verbose=False)


def _reference(vocab, prompt: str, new_tokens: int, *sampling: str) -> str:
    """The target alone's text for the prompt as the edge tokenizes it (`draftwire reference`)."""
    ids = vocab.tokenize(prompt.encode(), add_bos=True, special=False)
    argv = [VERIFIER, "reference", "--target", str(DEMO / "target"), "--json", "--ignore-eos"]
    argv += ["--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", str(new_tokens), *sampling]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return vocab.detokenize(json.loads(out.stdout)["token_ids"]).decode("utf-8", "replace")


def _post(url: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 11}], ids=["greedy", "seeded"])
def test_completions_equal_the_target_alone_streamed_or_not(client, vocab, sampling):
    args = {"temperature": 0.0, **sampling}
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, **args)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 32
    cli = ("--temperature", str(args["temperature"])) + (
        ("--seed", str(args["seed"])) if "seed" in args else ()
    )
    assert whole.choices[0].text == _reference(vocab, PROMPT, 32, *cli)
    pieces = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, stream=True, **args))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == whole.choices[0].text
    timings = whole.model_extra["timings"]
    assert timings["predicted_n"] == 32 and timings["draft_n"] >= timings["draft_n_accepted"] > 0
    assert timings["rounds"] > 0 and timings["tokens_per_round"] > 1


def test_chat_streams_with_usage_and_figures_in_the_last_chunks(client):
    messages = [{"role": "user", "content": "Return the sum of a list."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    last_choice = [c for c in chunks if c.choices][-1]
    assert last_choice.choices[0].finish_reason == whole.choices[0].finish_reason
    assert last_choice.model_extra["timings"]["predicted_n"] == whole.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_logprobs_and_penalties_equal_the_target_alones(client, vocab):
    """The openai client's logprobs=3 with penalties and a bias: the reply's tokens and log-probabilities
    are `draftwire reference`'s with the same settings; streamed, the same entries chunk by chunk."""
    settings = {"frequency_penalty": 0.6, "presence_penalty": 0.4, "logit_bias": {"13": -100}}
    cli = ["--frequency-penalty", "0.6", "--presence-penalty", "0.4", "--logit-bias", "13=-100"]
    ids = vocab.tokenize(PROMPT.encode(), add_bos=True, special=False)
    argv = [
        VERIFIER,
        "reference",
        "--target",
        str(DEMO / "target"),
        "--json",
        "--ignore-eos",
        "--logprobs",
        "3",
    ]
    argv += ["--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", "24", "--temperature", "0", *cli]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    reference = json.loads(out.stdout)
    assert 13 not in reference["token_ids"]
    whole = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=3, extra_body=settings
    ).choices[0]
    assert whole.text == vocab.detokenize(reference["token_ids"]).decode("utf-8", "replace")
    want = [t["logprob"] for t in reference["logprobs"]]
    assert whole.logprobs.token_logprobs == pytest.approx(want, abs=1e-6)
    assert [len(t) for t in whole.logprobs.top_logprobs] == [3] * 24
    for token, top in zip(reference["token_ids"], whole.logprobs.top_logprobs, strict=True):
        assert max(top.values()) == top[vocab.detokenize([token]).decode("utf-8", "replace")]  # greedy
    messages = [{"role": "user", "content": "Return the sum of a list."}]
    chat = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0.8, seed=5, **settings)
    reply = client.chat.completions.create(**chat, logprobs=True, top_logprobs=2).choices[0]
    content = reply.logprobs.content
    assert "".join(t.token for t in content) == reply.message.content
    assert all(
        len(t.top_logprobs) == 2 and t.logprob <= 0 and bytes(t.bytes).decode() == t.token for t in content
    )
    chunks = list(client.chat.completions.create(**chat, logprobs=True, top_logprobs=2, stream=True))
    streamed = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = client.chat.completions.create(**chat).choices[0]
    assert plain.logprobs is None and plain.message.content == reply.message.content


def test_stop_strings_cut_as_openai_does(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0).choices[0]
    text = whole.text
    stop = text[10:13]  # a string the reply contains
    assert stop and stop in text
    for stream in (False, True):
        reply = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=40,
            temperature=0,
            stop=[stop, "never-there"],
            stream=stream,
        )
        chunks = list(reply) if stream else [reply]
        cut = "".join(c.choices[0].text for c in chunks if c.choices)
        assert cut == text[: text.index(stop)]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature", "number"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p", "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n", "n = 1"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]},
            "stop",
            "at most",
        ),
        ({"messages": []}, "messages", "non-empty"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 2.5},
            "frequency_penalty",
            "[-2, 2]",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, "logit_bias", "token id"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}},
            "logit_bias",
            "[-100, 100]",
        ),
        # Ids out of range (issue 55): past the vocabulary (a 500 from the drafter's indexing before), past
        # uint32 (a 500 from the wire, or cut to its low 32 bits: 4294968073 acted as 777).
        (
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"100000": 1}},
            "logit_bias",
            "vocabulary",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"4294967301": 1}},
            "logit_bias",
            "2**32",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"4294968073": 100}},
            "logit_bias",
            "2**32",
        ),
        # Divisors so small that the logits overflow (NaN logprobs, garbage tokens before).
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5e-324}, "temperature", "at least"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 5e-324},
            "repetition_penalty",
            "[0.0001, 10]",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs", "logprobs"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "[0, 20]",
        ),
        # Prompt plus max_tokens over the context: refused by the edge before anything is drafted.
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000}, "max_tokens", "context"),
    ],
)
def test_bad_parameters_get_400_with_an_openai_error(edge, body, param, words):
    for stream in (False, True):
        status, reply = _post(edge.url + "v1/chat/completions", {**body, "stream": stream})
        assert status == 400, reply
        assert reply["error"]["type"] == "invalid_request_error" and words in reply["error"]["message"]
        assert reply["error"]["param"] == param


def test_the_openai_client_raises_the_apis_own_errors(client):
    """The official client maps our errors as it maps OpenAI's: its exception class, code and param."""
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=hi)
    assert unknown.value.code == "model_not_found" and MODEL in unknown.value.message
    with pytest.raises(openai.BadRequestError) as role:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    assert role.value.param == "messages.[0].role"
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as long:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100_000, stream=stream)
        assert long.value.param == "max_tokens" and "context" in long.value.message


def test_malformed_json_gets_400(edge):
    status, reply = _post(edge.url + "v1/chat/completions", None, raw=b"{not json")
    assert status == 400 and "JSON" in reply["error"]["message"]


def test_models_and_health(edge, verifier):
    status, models = _get(edge.url + "v1/models")
    assert status == 200 and models["data"][0]["id"] == MODEL
    assert models["data"][0]["meta"]["draft"] == DRAFT.name
    assert _get(edge.url + "health") == (200, {"status": "ok", "verifier": verifier.address})


def test_an_unreachable_verifier_is_503_with_the_reason(tmp_path):
    with EdgeProcess("127.0.0.1:1", DRAFT, db=tmp_path / "e.sqlite3", executable=EDGE) as app:
        status, reply = _post(
            app.url + "v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
        )
        assert status == 503 and "unavailable" in reply["error"]["message"]
        status, health = _get(app.url + "health")
        assert status == 503 and health["status"] == "unavailable" and "unreachable" in health["reason"]


def _verifier_stats(address: str) -> pb.ServerStats:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest(), timeout=10)


def test_a_client_that_disconnects_mid_stream_cancels_the_verifier_session(edge, verifier):
    before = _verifier_stats(verifier.address)
    body = {"prompt": PROMPT, "max_tokens": 900, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        edge.url + "v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: ")  # the reply has started
    response.close()
    deadline = time.monotonic() + 20
    while (stats := _verifier_stats(verifier.address)).active_sessions and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stats.active_sessions == 0
    assert stats.sessions_opened == before.sessions_opened + 1
    assert stats.generated_tokens - before.generated_tokens < 900  # it did not run to the end
    # ...and the app serves the next request.
    status, _ = _post(edge.url + "v1/completions", {"prompt": PROMPT, "max_tokens": 4})
    assert status == 200


def test_conversations_are_kept_and_their_next_turn_reuses_the_verifiers_cache(verifier, tmp_path):
    with EdgeProcess(verifier.address, DRAFT, db=tmp_path / "edge.sqlite3", executable=EDGE) as edge:
        _conversation_survives_a_kill(edge, verifier, tmp_path / "edge.sqlite3")


def _conversation_survives_a_kill(edge, verifier, db):
    status, conversation = _post(
        edge.url + "api/conversations", {"settings": {"temperature": 0, "max_tokens": 16}}
    )
    assert status == 201
    url = edge.url + f"api/conversations/{conversation['id']}"
    first_turn = "Return the sum of a list."
    status, first = _post(url + "/messages", {"content": first_turn, "stream": False})
    assert status == 200 and first["conversation_id"] == conversation["id"]
    status, second = _post(url + "/messages", {"content": "Now the product.", "stream": False})
    assert status == 200
    # Turn 2 starts from turn 1's kept cache: only its new tokens are computed.
    assert second["timings"]["cache_n"] >= first["usage"]["total_tokens"] - 1
    assert (
        second["timings"]["prompt_n"] < second["usage"]["prompt_tokens"] - first["usage"]["total_tokens"] + 2
    )
    _, stored = _get(url)
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant", "user", "assistant"]
    assert stored["messages"][1]["content"] == first["choices"][0]["message"]["content"]
    assert stored["messages"][3]["figures"]["timings"]["cache_n"] == second["timings"]["cache_n"]
    assert stored["title"] == first_turn and stored["settings"]["max_tokens"] == 16
    assert any(
        c["id"] == conversation["id"] for c in _get(edge.url + "api/conversations")[1]["conversations"]
    )

    # A kill of the edge loses nothing written: a new edge on the same database has the conversation.
    edge.proc.send_signal(signal.SIGKILL)
    edge.proc.wait()
    with EdgeProcess(verifier.address, DRAFT, db=db, executable=EDGE) as again:
        _, kept = _get(again.url + f"api/conversations/{conversation['id']}")
        assert kept["messages"] == stored["messages"]
        request = urllib.request.Request(
            again.url + f"api/conversations/{conversation['id']}", method="DELETE"
        )
        assert urllib.request.urlopen(request).status == 204
        assert _get(again.url + f"api/conversations/{conversation['id']}")[0] == 404


def _metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url + "metrics", timeout=30).read().decode()
    return {
        s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_apps_metrics_count_its_replies_and_errors(edge, client):
    before = _metrics(edge.url)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    _post(edge.url + "v1/completions", {"prompt": PROMPT, "top_k": -1})
    after = _metrics(edge.url)
    delta = lambda name: after.get(name, 0) - before.get(name, 0)  # noqa: E731
    timings = reply.model_extra["timings"]
    assert delta("draftwire:spec_decode_num_drafts_total") == timings["rounds"]
    assert delta("draftwire:spec_decode_num_draft_tokens_total") == timings["draft_n"]
    assert delta("draftwire:spec_decode_num_accepted_tokens_total") == timings["draft_n_accepted"]
    assert delta("draftwire:edge_generated_tokens_total") == 12
    assert delta("draftwire:edge_replies_total{finish_reason=length}") == 1
    assert delta("draftwire:edge_errors_total{status=400}") == 1
    assert delta("draftwire:edge_time_to_first_token_seconds_count") == 1
    assert timings["verify_ms"] > 0 and timings["mean_batch_size"] >= 1
    assert 1 <= timings["min_gamma_cap"] <= timings["gamma_cap"] <= 16  # the verifier's cap reached the page


@pytest.mark.parametrize("drafting", ["ngram", "none"])
def test_a_thin_device_gets_the_same_text(verifier, vocab, tmp_path, drafting):
    """No draft model on the device, only its vocabulary: the verifier decodes (alone, or drafting by
    prompt lookup) and the reply is still the target alone's."""
    extra = ("--vocab", str(DRAFT), "--server-drafting", drafting)
    with EdgeProcess(verifier.address, None, *extra, db=tmp_path / "e.sqlite3", executable=EDGE) as thin:
        client = OpenAI(base_url=thin.url + "v1", api_key="unused")
        reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
        assert reply.choices[0].text == _reference(vocab, PROMPT, 24, "--temperature", "0")
        if drafting == "none":
            assert reply.model_extra["timings"]["draft_n"] == 0
