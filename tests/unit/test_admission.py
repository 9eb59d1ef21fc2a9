"""Admission in process: caps, the per-client rate, the KV budget and the stale-proposal window, as
tables of opens and releases on a hand-driven clock."""

import pytest

from verifier_service.admission import Admission, AdmissionConfig, Refused, Window

MiB = 1 << 20


def limits(**kwargs) -> AdmissionConfig:
    """A config as the server resolves it, with no KV budget unless one is given."""
    return AdmissionConfig(**{"kv_budget_bytes": 0, **kwargs})


# Each step: ("open", key, client, kv_bytes, now) -> True (admitted) or a refusal's text; ("close", key).
CASES = [
    pytest.param(
        limits(max_sessions=2),
        [
            ("open", "a", "x", 0, 0, True),
            ("open", "b", "y", 0, 0, True),
            ("open", "c", "z", 0, 0, "maximum of 2"),
        ],
        id="global cap refuses the third",
    ),
    pytest.param(
        limits(max_sessions=2),
        [
            ("open", "a", "x", 0, 0, True),
            ("open", "b", "y", 0, 0, True),
            ("close", "a"),
            ("open", "c", "z", 0, 0, True),
        ],
        id="a release makes room",
    ),
    pytest.param(
        limits(max_sessions_per_client=1),
        [
            ("open", "a", "x", 0, 0, True),
            ("open", "b", "x", 0, 0, "'x' holds"),
            ("open", "c", "y", 0, 0, True),
        ],
        id="per-client cap counts each client apart",
    ),
    pytest.param(
        limits(sessions_per_minute=2),
        [
            ("open", "a", "x", 0, 0, True),
            ("close", "a"),
            ("open", "b", "x", 0, 10, True),
            ("close", "b"),
            ("open", "c", "x", 0, 20, "last minute"),
            ("open", "d", "y", 0, 20, True),
            ("open", "e", "x", 0, 60.5, True),
        ],
        id="rate per client per minute, sliding",
    ),
    pytest.param(
        limits(kv_budget_bytes=10 * MiB, client_kv_share=1),
        [
            ("open", "a", "x", 6 * MiB, 0, True),
            ("open", "b", "y", 5 * MiB, 0, "5 MiB of KV cache; 4 MiB"),
            ("open", "c", "y", 4 * MiB, 0, True),
            ("close", "a"),
            ("open", "d", "y", 6 * MiB, 0, True),
        ],
        id="kv budget",
    ),
    pytest.param(
        limits(max_sessions=1, sessions_per_minute=1),
        [
            ("open", "a", "x", 0, 0, True),
            ("open", "b", "x", 0, 1, "maximum of 1"),
            ("close", "a"),
            ("open", "c", "x", 0, 2, "last minute"),
        ],
        id="a refusal by a cap does not spend the rate, the admitted open does",
    ),
    pytest.param(
        limits(),
        [("open", str(i), "x", 10**12, 0, True) for i in range(50)],
        id="no limits: everything is admitted",
    ),
]


@pytest.mark.parametrize("config, steps", CASES)
def test_admission_table(config, steps):
    admission = Admission(config)
    for step in steps:
        if step[0] == "close":
            admission.release(step[1])
            continue
        _, key, client, kv, now, expected = step
        if expected is True:
            admission.admit(key, client, kv, now)
        else:
            active, reserved = admission.active, admission.kv_reserved
            with pytest.raises(Refused, match=expected) as refused:
                admission.admit(key, client, kv, now)
            assert refused.value.retry_after_s > 0
            assert (admission.active, admission.kv_reserved) == (active, reserved)  # nothing held


def test_release_is_idempotent_and_frees_everything():
    admission = Admission(limits(max_sessions=1, kv_budget_bytes=MiB, client_kv_share=1))
    admission.admit("a", "x", MiB, 0)
    admission.release("a")
    admission.release("a")
    admission.release("never")
    assert (admission.active, admission.kv_reserved) == (0, 0)
    admission.admit("b", "x", MiB, 0)


def test_the_rate_refusal_says_when_a_slot_frees():
    admission = Admission(limits(sessions_per_minute=1))
    admission.admit("a", "x", 0, 100.0)
    with pytest.raises(Refused) as refused:
        admission.admit("b", "x", 0, 130.0)
    assert refused.value.retry_after_s == pytest.approx(30.0)


def test_the_rate_table_forgets_clients_that_opened_nothing_for_a_minute():
    """Each client name gets a window; a stream of one-off names (peer addresses) must not grow it forever,
    and a client still inside its minute keeps its count."""
    admission = Admission(limits(sessions_per_minute=1))
    for n in range(1000):
        admission.admit(f"s{n}", f"10.0.{n // 256}.{n % 256}", 0, n * 0.01)
        admission.release(f"s{n}")
    assert admission.rate_clients == 1000  # all within one minute
    admission.admit("late", "steady", 0, 65.0)  # the first half has expired; the sweep drops them
    assert admission.rate_clients == 1000 - 501 + 1
    admission.admit("later", "other", 0, 100.0)  # no sweep yet: at most one a minute
    assert admission.rate_clients == 1000 - 501 + 2
    admission.admit("last", "third", 0, 126.0)
    assert admission.rate_clients == 2  # "steady" (its open at 65 s was 61 s ago) is gone too
    with pytest.raises(Refused):
        admission.admit("again", "other", 0, 127.0)  # a client inside its minute keeps its count


def test_window_counts_a_sliding_second():
    window = Window(3, 1.0)
    assert [window.allow(t) for t in (0.0, 0.1, 0.2, 0.3, 1.05, 1.1)] == [True, True, True, False, True, True]


def test_one_client_reserves_at_most_its_share_of_the_budget():
    """A client (a connection when anonymous) cannot lock the others out: past half the budget it is
    refused while another client still gets in, and its release gives its share back."""
    admission = Admission(limits(kv_budget_bytes=10 * MiB, client_kv_share=0.5))
    admission.admit("a", "flood", 4 * MiB, 0)
    with pytest.raises(Refused, match="'flood' holds 4 MiB of the 5 MiB one client may reserve"):
        admission.admit("b", "flood", 2 * MiB, 0)
    admission.admit("c", "bystander", 5 * MiB, 0)
    assert admission.kv_room == 1 * MiB  # what kept caches may hold beside the reservations
    admission.release("a")
    admission.admit("d", "flood", 5 * MiB, 0)
    assert admission.kv_room == 0


def test_the_budget_must_be_sized_before_admission_starts():
    with pytest.raises(ValueError, match="sized by the server"):
        Admission(AdmissionConfig())
    assert AdmissionConfig().max_sessions and AdmissionConfig().client_kv_share < 1  # on by default


def test_refused_opens_past_the_limit_refuse_the_client_unread_for_the_rest_of_the_second():
    from verifier_service.admission import RefusedUnread

    admission = Admission(limits(max_refused_opens_per_s=3))
    for t in (0.0, 0.1, 0.2):
        admission.check_refusals("x", t)  # room yet: read
        admission.refused_open("x", t)
    with pytest.raises(RefusedUnread) as refused:
        admission.check_refusals("x", 0.5)
    assert refused.value.retry_after_s == pytest.approx(0.5)  # until the refusal at 0.0 is a second old
    admission.check_refusals("y", 0.5)  # another client is read
    admission.check_refusals("x", 1.01)  # the window moved on
    admission.refused_open("x", 70.0)  # the sweep forgets clients of a minute ago
    assert set(admission._refused) == {"x"} and len(admission._refused["x"]._times) == 1


def test_no_limit_on_refused_opens_when_it_is_zero():
    admission = Admission(limits(max_refused_opens_per_s=0))
    for t in range(100):
        admission.refused_open("x", t / 1000)
    admission.check_refusals("x", 0.1)


@pytest.mark.parametrize(
    "client, party",
    [
        ("alice", "alice"),
        ("#connection ipv4:10.0.0.1:51234", "#address ipv4:10.0.0.1"),
        ("#connection ipv4:10.0.0.1:40000", "#address ipv4:10.0.0.1"),
        ("#connection ipv6:[::1]:51234", "#address ipv6:[::1]"),
        ("#connection ipv6:%5B::1%5D:51234", "#address ipv6:[::1]"),  # as gRPC writes it
        ("#connection unix:/tmp/s", "#address unix:/tmp/s"),
        ("#connection ", "#address "),
    ],
)
def test_an_anonymous_client_is_its_peer_address_without_the_port(client, party):
    from verifier_service.admission import party_of

    assert party_of(client) == party


def test_the_per_client_cap_is_a_quarter_of_the_sessions_by_default():
    assert AdmissionConfig().sessions_per_client == 64  # binds at the default 256
    assert AdmissionConfig(max_sessions=6).sessions_per_client == 1
    assert AdmissionConfig(max_sessions=0).sessions_per_client == 0  # no global cap: none derived
    assert AdmissionConfig(max_sessions_per_client=0).sessions_per_client == 0  # asked for none
    assert AdmissionConfig().client_kv_share == 0.25


def test_many_anonymous_connections_from_one_host_are_one_client_and_a_bystander_gets_in():
    """The probe's flood: 30 connections from one host took every slot (each connection was a client of
    its own). At default caps the host now holds its quarter and another host is admitted."""
    admission = Admission(limits())
    flood = [f"#connection ipv4:10.0.0.9:{40000 + i}" for i in range(30)]
    admitted = 0
    for i in range(256):
        try:
            admission.admit(f"f{i}", flood[i % 30], 0, 0)
            admitted += 1
        except Refused as e:
            assert "'#address ipv4:10.0.0.9' holds its maximum of 64 sessions" in str(e)
            assert e.retry_after_s > 0
    assert admitted == 64
    admission.admit("bystander", "#connection ipv4:10.0.0.7:5000", 0, 0)


def test_a_small_kv_budget_is_shared_by_host():
    """--kv-budget-mb 16: 20 connections of one host filled it with 91 sessions; now a quarter."""
    admission = Admission(limits(kv_budget_bytes=16 * MiB))
    held = 0
    for i in range(91):
        try:
            admission.admit(f"f{i}", f"#connection ipv4:10.0.0.9:{40000 + i % 20}", 176 * 1024, 0)
            held += 1
        except Refused as e:
            assert "of the 4 MiB one client may reserve" in str(e)
    assert held * 176 * 1024 <= 4 * MiB
    admission.admit("bystander", "#connection ipv4:10.0.0.7:5000", 4 * MiB, 0)


def full(**kwargs) -> Admission:
    """A verifier of 8 sessions at most, no per-client cap: two flooders hold 6 and 2."""
    admission = Admission(limits(max_sessions=8, max_sessions_per_client=0, **kwargs))
    for i in range(6):
        admission.admit(f"a{i}", "flood", 0, 0)
        admission.idle(f"a{i}", float(i))
    for i in range(2):
        admission.admit(f"b{i}", "other", 0, 0)
        admission.idle(f"b{i}", 0.0)
    return admission


def test_a_full_verifier_preempts_the_longest_idle_session_of_the_client_most_over_its_share():
    admission = full()
    with pytest.raises(Refused, match="maximum of 8"):
        admission.admit("n", "newcomer", 0, 10.0)
    # Fair share: 8 sessions over 3 clients; "flood" holds 6, "other" 2 (within its share).
    assert admission.victims("newcomer", 0, 10.0) == ["a0"]
    admission.busy("a0")  # a session with work in hand is not idle
    assert admission.victims("newcomer", 0, 10.0) == ["a1"]
    assert admission.victims("newcomer", 0, 2.5) == []  # a1..a5 idle less than preempt_idle_s
    assert admission.victims("flood", 0, 10.0) == []  # a client over its share preempts nobody
    assert admission.victims("other", 0, 10.0) == ["a1"]  # 3 within 8 / 2 once in: "other" may
    admission.release("a1")
    admission.admit("n", "newcomer", 0, 10.0)


def test_no_preemption_when_it_is_off_or_cannot_make_room():
    assert full(preempt_idle_s=0).victims("newcomer", 0, 10.0) == []
    admission = Admission(limits(max_sessions=2, max_sessions_per_client=0))
    admission.admit("a", "x", 0, 0)
    admission.admit("b", "y", 0, 0)
    admission.idle("a", 0.0)
    admission.idle("b", 0.0)
    assert admission.victims("z", 0, 10.0) == []  # z's one would be past its share of 2 / 3 too
    admission = Admission(limits(max_sessions=4, max_sessions_per_client=0))
    for key in "abcd":
        admission.admit(key, "x", 0, 0)
    admission.idle("a", 0.0)
    assert admission.victims("z", 0, 10.0) == ["a"]
    admission.busy("a")
    assert admission.victims("z", 0, 10.0) == []  # x is over its share, but busy
