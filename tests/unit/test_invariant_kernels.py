"""Invariant mode's kernels alone: a row's result is bitwise the same whatever else shares the call.

Small random tensors and a tiny random Llama; a few seconds. The last tests show that torch's own
float32 kernels are not invariant on this CPU, so the equalities above them are known to bite.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM

from tests.capability import dtype_params
from verifier_service import attention_checks, invariant
from verifier_service.attention import (
    CAUSAL_MIN,
    batched_block_attention,
    block_attention,
    fused_attention,
)
from verifier_service.invariant import make_invariant, pack_weight, packed_linear

DTYPES = dtype_params(torch.float32, torch.bfloat16)
pytestmark = pytest.mark.skipif(
    not invariant.supported(torch.float32), reason="invariant mode needs torch's oneDNN on CPU"
)


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread unless a test asks for more (the verifier's rig gives it one core)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request, one_thread):
    torch.set_num_threads(request.param)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fan_in, fan_out", [(96, 160), (1536, 576)])
def test_linear_rows_equal_alone_for_any_row_count(dtype, fan_in, fan_out, threads):
    """Each row of an M-row call equals the row computed alone, for M across one-row, many-row and
    chunked calls (past max_rows), with a bias, and with other rows of any content beside it."""
    g = torch.Generator().manual_seed(fan_in + fan_out)
    weight = (torch.randn(fan_out, fan_in, generator=g) / fan_in**0.5).to(dtype)
    bias = torch.randn(fan_out, generator=g).to(dtype)
    max_rows = invariant.ROW_POLICY[dtype][2]
    x = torch.randn(max_rows + 5, fan_in, generator=g).to(dtype)
    packed = pack_weight(weight)
    alone = torch.cat([packed_linear(x[i : i + 1], packed, bias) for i in range(x.shape[0])])
    for rows in [1, 2, 3, 5, 9, 17, 33, 64, max_rows, max_rows + 1, max_rows + 5]:
        assert torch.equal(packed_linear(x[:rows], packed, bias), alone[:rows]), rows
    # The same row at another place among other rows (and in a 3-d batch of rows).
    others = torch.randn(4, 9, fan_in, generator=g).to(dtype) * 3
    others[2, 6] = x[0]
    assert torch.equal(packed_linear(others, packed, bias)[2, 6], alone[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_calls_the_load_keeps_are_invariant_at_every_row_count(dtype, threads):
    """The most rows of a call that the load proves (proven_rows) give each row the same bits
    alone as among any count of rows up to 300. A check at sampled counts once kept calls of 1,024
    bfloat16 rows on a Xeon with AMX, where 1536 -> 576 gave rows other bits among 201 to 256 rows (a Ray
    pool under load then wrote other tokens than the target alone)."""
    min_rows = invariant.ROW_POLICY[dtype][1]
    most = invariant.proven_rows(dtype, {(1536, 576)}, min_rows)
    g = torch.Generator().manual_seed(7)
    packed = pack_weight((torch.randn(576, 1536, generator=g) / 1536**0.5).to(dtype))
    x = torch.randn(300, 1536, generator=g).to(dtype)
    alone = [packed_linear(x[i : i + 1], packed, None, min_rows, most) for i in range(x.shape[0])]
    changed = [
        n
        for n in range(1, x.shape[0] + 1)
        if not torch.equal(packed_linear(x[:n], packed, None, min_rows, most)[n - 1], alone[n - 1][0])
    ]
    assert changed == [], f"calls of up to {most} rows"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_checks_verdict_on_a_large_shape_is_the_truth(dtype, threads):
    """Qwen2.5-1.5B's down projection, 8960 -> 1536 (a large shape, checked at sampled counts): the check
    passes it exactly where every row of every count up to one call (all to 65, then every 7th) has the
    bits it has alone. A check that compared only each count's first and last rows passed it in
    bfloat16 on a Xeon with AMX at one thread, where rows between them changed among 28 to 128 rows."""
    _, min_rows, most = invariant.ROW_POLICY[dtype]
    try:
        invariant.check_linear(dtype, {(8960, 1536)}, min_rows=min_rows, max_rows=most)
        passed = True
    except invariant.NotInvariant:
        passed = False
    g = torch.Generator().manual_seed(3)
    packed = pack_weight((torch.randn(1536, 8960, generator=g) / 8960**0.5).to(dtype))
    x = torch.randn(most, 8960, generator=g).to(dtype)
    alone = torch.cat([packed_linear(x[i : i + 1], packed, None, min_rows, most) for i in range(most)])
    counts = sorted({*range(1, 66), *range(66, most, 7), most})
    changed = [
        n for n in counts if not torch.equal(packed_linear(x[:n], packed, None, min_rows, most), alone[:n])
    ]
    assert passed == (changed == []), f"check passed: {passed}; rows changed among {changed[:8]}... rows"


def test_a_kernel_whose_bits_follow_the_thread_count_is_refused(monkeypatch, threads):
    """Row-invariant at every count, yet other bits at another thread count: the check refuses it, since
    two verifiers of one numerics identity may run different thread counts. (A stand-in kernel: the
    real one of this CPU may or may not do it.)"""
    real = invariant._linear_of

    def by_threads(weight, kernels, min_rows, max_rows=None):
        linear = real(weight, kernels, min_rows, max_rows)
        return lambda x: linear(x) + torch.get_num_threads()

    monkeypatch.setattr(invariant, "_linear_of", by_threads)
    with pytest.raises(invariant.NotInvariant, match=f"at {3 - threads} threads than at {threads}"):
        invariant.check_linear(torch.float32, [(96, 160)])


def test_long_inputs_go_in_whole_calls_first_then_in_the_proven_range():
    """A prefill's rows: calls of exactly the whole counts, the largest that fits first, then the rest in
    calls of at most max_rows, a short one padded; each row's result lands in its place."""
    sizes = []

    def linear(chunk):
        sizes.append(chunk.shape[0])
        return chunk * 2

    x = torch.arange(21.0)[:, None]
    out = invariant.in_row_chunks(x, linear, min_rows=2, max_rows=3, whole=(8, 4))
    assert sizes == [8, 8, 4, 2]  # 21 = 8 + 8 + 4 + one row padded to 2
    assert torch.equal(out, x * 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_whole_calls_the_load_proves_give_the_proven_ranges_bits(dtype, threads):
    """The load proves each whole count on a layer's own packed weight; a prefill through the layer then
    gives every row the bits of that row alone (here: 1,800 rows, SmolLM2's 576 -> 1536)."""
    _, _, most = invariant.ROW_POLICY[dtype]
    g = torch.Generator().manual_seed(8)
    layer = torch.nn.Linear(576, 1536, bias=False).to(dtype)
    make_invariant(torch.nn.Sequential(layer), check=False, padding=4)
    proven = invariant.whole_calls({(576, 1536): layer}, 4, most)
    assert proven == {(576, 1536): tuple(c for c in invariant.WHOLE_CALLS if c > most)}
    layer.max_rows, layer.whole = most, proven[(576, 1536)]
    x = torch.randn(1800, 576, generator=g).to(dtype)
    with torch.inference_mode():
        out = layer(x)
        for i in (0, 1, 700, 1023, 1024, 1535, 1536, 1799):
            assert torch.equal(out[i : i + 1], layer(x[i : i + 1])), i


def test_a_whole_count_with_other_bits_is_not_made(monkeypatch):
    """Where one call of a whole count gives a row other bits than the proven range, that count is made
    for no shape, and the others still are; a layer past WHOLE_WEIGHTS gets none."""
    layers = {shape: torch.nn.Linear(*shape, bias=False) for shape in [(96, 160), (160, 96)]}
    make_invariant(torch.nn.Sequential(*layers.values()), check=False, padding=4)
    real = invariant.packed_linear

    def off_at_512(x, packed, bias=None, min_rows=None, max_rows=None, whole=()):
        out = real(x, packed, bias, min_rows, max_rows, whole)
        return out + 1 if 512 in whole else out

    monkeypatch.setattr(invariant, "packed_linear", off_at_512)
    assert set(invariant.whole_calls(layers, 4, 256).values()) == {(1024,)}
    monkeypatch.setattr(invariant, "WHOLE_WEIGHTS", 96 * 160 - 1)
    assert invariant.whole_calls(layers, 4, 256) == {}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_is_close_to_torch(dtype):
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(160, 96, generator=g) / 96**0.5).to(dtype)
    x = torch.randn(7, 96, generator=g).to(dtype)
    torch.testing.assert_close(packed_linear(x, pack_weight(weight)), F.linear(x, weight))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_check_linear_passes_here(dtype):
    invariant.check_linear(dtype, [(96, 160), (160, 96)])


def _cache(held: int, capacity: int, kv_heads: int, dtype, g) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as the engine holds them: views of the first `held` positions of a larger buffer."""
    keys, values = (torch.randn(1, kv_heads, capacity, 32, generator=g).to(dtype) for _ in range(2))
    return keys[:, :, :held], values[:, :, :held]


# The two invariant attentions: fixed key blocks of our own, and torch's fused kernel in whole blocks.
ATTENDS = pytest.mark.parametrize("attend", [block_attention, fused_attention], ids=["blocks", "fused"])


@ATTENDS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [None, 7])
def test_attention_rows_equal_one_query_at_a_time(dtype, window, threads, attend):
    """The query at each position gives the same output among n queries (n = 2..17, and the whole 40,
    past one call of the fused kernel's rows) as a one-query call over the cache up to it, whatever
    the buffer's capacity behind the view (grouped-query heads)."""
    g = torch.Generator().manual_seed(2)
    held, heads = 40, 6
    keys, values = _cache(held, 64, 2, dtype, g)
    queries = torch.randn(1, heads, held, 32, generator=g).to(dtype)
    for n in [2, 5, 9, 17, held]:
        out = attend(queries[:, :, held - n :], keys, values, 0.17, window)
        for j in range(n):
            p = held - n + j
            # The one-position forward's cache: a different buffer (capacity 128) holding the same prefix.
            k1, v1 = (torch.zeros(1, 2, 128, 32, dtype=dtype) for _ in range(2))
            k1[:, :, : p + 1], v1[:, :, : p + 1] = keys[:, :, : p + 1], values[:, :, : p + 1]
            one = attend(queries[:, :, p : p + 1], k1[:, :, : p + 1], v1[:, :, : p + 1], 0.17, window)
            assert torch.equal(out[0, j], one[0, 0]), (n, j)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_long_prefill_in_one_causal_call_gives_each_query_its_bits_alone(dtype, threads):
    """A prefill from position 0 of CAUSAL_MIN queries or more goes through the fused kernel as one causal
    call (query rows padded to the kernel's blocks of 256, keys to 512, read from a buffer's room); each
    query gets the bits of a one-query call over the cache up to it and of the last query of a round,
    at positions on both sides of every block edge, the last one among them."""
    g = torch.Generator().manual_seed(4)
    held = CAUSAL_MIN + 45  # 813: query blocks of 256 with a tail, key blocks of 512 with a tail
    keys, values = _cache(held, 1024, 2, dtype, g)
    queries = torch.randn(1, 6, held, 32, generator=g).to(dtype)
    whole = fused_attention(queries, keys, values, 0.17)
    assert whole.shape == (1, held, 6, 32)
    for p in [0, 1, 255, 256, 511, 512, 767, 768, held - 1]:
        seen = slice(0, p + 1)
        alone = fused_attention(
            queries[:, :, p : p + 1], keys[:, :, seen].clone(), values[:, :, seen].clone(), 0.17
        )
        round_ = fused_attention(
            queries[:, :, max(0, p - 4) : p + 1], keys[:, :, seen], values[:, :, seen], 0.17
        )
        assert torch.equal(whole[0, p], alone[0, 0]) and torch.equal(whole[0, p], round_[0, -1]), p


@ATTENDS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_matches_causal_sdpa(dtype, attend):
    g = torch.Generator().manual_seed(3)
    keys, values = _cache(30, 30, 2, dtype, g)
    queries = torch.randn(1, 6, 9, 32, generator=g).to(dtype)
    mask = torch.arange(30)[None, :] <= torch.arange(21, 30)[:, None]
    expected = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=0.2, enable_gqa=True
    )
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(
        attend(queries, keys, values, 0.2), expected.transpose(1, 2), atol=atol, rtol=0
    )


def _exact(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """A transformers attention function for a batch of one sequence over a DynamicCache."""
    return block_attention(query, key, value, scaling, kwargs.get("sliding_window")), None


AttentionInterface.register("invariant_test_exact", _exact)


def _tiny_llama(
    dtype, invariant_mode: bool, padding: int | None = None, kernels: str = "onednn", check: bool = False
) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    if invariant_mode:  # the checks have tests of their own; a model checked gets its whole calls
        make_invariant(model, kernels, check=check, padding=padding)
        model.set_attn_implementation("invariant_test_exact")
    return model


def _logits_one_at_a_time_and_in_rounds(model, ids: list[int], prefix: int, width: int, first: int = 1):
    """Logits of positions prefix.. computed `first` (one) per forward, and `width` per forward, over a
    cache."""
    with torch.inference_mode():
        runs = []
        for step in (first, width):
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([ids[:prefix]]), past_key_values=cache, use_cache=True)
            logits = []
            for start in range(prefix, len(ids), step):
                chunk = ids[start : start + step]
                out = model(input_ids=torch.tensor([chunk]), past_key_values=cache, use_cache=True)
                logits.append(out.logits[0])
            runs.append(torch.cat(logits))
    return runs


@pytest.mark.parametrize("kernels", invariant.BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [5, 9, 17])
def test_tiny_llama_logits_equal_one_position_forwards(dtype, width, kernels):
    """The whole model in invariant mode, on either backend: positions run `width` at a time give
    bitwise the logits of one-position forwards over the same cache."""
    model = _tiny_llama(dtype, invariant_mode=True, kernels=kernels)
    ids = [(37 * i + 11) % 512 for i in range(60)]
    one, rounds = _logits_one_at_a_time_and_in_rounds(model, ids, 9, width)
    assert torch.equal(one, rounds)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_long_prefill_in_whole_calls_gives_each_position_the_bits_of_rounds(dtype):
    """A prompt of 1,299 positions in one forward (a whole call of 1,024 rows, then 256 and 19 rows)
    gives every position the logits it gets in rounds of 5 over the same cache."""
    model = _tiny_llama(dtype, invariant_mode=True, check=True)
    layers = [m for m in model.model.modules() if isinstance(m, invariant.InvariantLinear)]
    proven = tuple(c for c in invariant.WHOLE_CALLS if c > invariant.ROW_POLICY[dtype][2])
    assert {m.whole for m in layers} == {proven} and model.lm_head.whole == ()  # a prefill's last row
    ids = [(37 * i + 11) % 512 for i in range(1300)]
    whole, rounds = _logits_one_at_a_time_and_in_rounds(model, ids, 1, 5, first=1299)
    assert torch.equal(whole, rounds)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("min_rows", invariant.PADDINGS)
def test_check_linear_passes_at_every_padding_tried(dtype, min_rows):
    """Each minimum make_invariant may choose is inside the invariant range, checked as at load."""
    invariant.check_linear(dtype, [(96, 160), (1536, 576)], min_rows=min_rows)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_paddings_give_the_same_bits_and_the_load_keeps_the_faster(dtype):
    """The padding is a speed choice only: the tiny model's logits are the same bits at every padding
    tried, in rounds as one position at a time. make_invariant times them and keeps one of them on
    every layer; choose_padding keeps the faster (the larger on a tie), whichever it is on a CPU."""
    ids = [(37 * i + 11) % 512 for i in range(30)]
    runs = []
    for padding in invariant.PADDINGS:
        model = _tiny_llama(dtype, invariant_mode=True, padding=padding)
        layers = [m for m in model.modules() if isinstance(m, invariant.InvariantLinear)]
        assert layers and all(m.min_rows == padding for m in layers)
        runs += _logits_one_at_a_time_and_in_rounds(model, ids, 9, 5)
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    model = _tiny_llama(dtype, invariant_mode=False)
    chosen = make_invariant(model)  # timed here, and checked at the padding chosen
    assert chosen in invariant.PADDINGS
    assert {m.min_rows for m in model.modules() if isinstance(m, invariant.InvariantLinear)} == {chosen}
    assert invariant.choose_padding({2: 0.180, 4: 0.201}) == 2  # the EPYC of 2026-11-27's second VM
    assert invariant.choose_padding({2: 0.584, 4: 0.401}) == 4  # the first one's
    assert invariant.choose_padding({2: 0.2, 4: 0.2}) == 4


def test_time_paddings_times_each_padding_tried():
    model = _tiny_llama(torch.float32, invariant_mode=True)
    layers = [m for m in model.modules() if isinstance(m, invariant.InvariantLinear)]
    seconds = invariant.time_paddings(layers, repeats=1)
    assert set(seconds) == set(invariant.PADDINGS) and all(s > 0 for s in seconds.values())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_portable_linear_rows_equal_alone(dtype, threads):
    """The portable backend (F.linear in calls inside the device's row range) passes the load's check
    on the SmolLM2 and Qwen2.5 MLP shapes, and its rows are close to torch's."""
    invariant.check_linear(dtype, [(96, 160), (576, 1536)], kernels="portable")
    g = torch.Generator().manual_seed(6)
    weight = (torch.randn(160, 96, generator=g) / 96**0.5).to(dtype)
    x = torch.randn(40, 96, generator=g).to(dtype)
    low, high = invariant.portable_rows(dtype)
    out = invariant.in_row_chunks(x, lambda c: F.linear(c, weight), low, high)
    torch.testing.assert_close(out, F.linear(x, weight))


@ATTENDS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_is_invariant_at_long_context(dtype, threads, attend):
    """The load's attention check: a query alone, as the last of a round and inside a whole prefill of
    1,317 positions (several key blocks and query chunks, past 1,024 keys), with and without a window."""
    attention_checks.check_attention(dtype, attend=attend)


def test_the_fused_attention_is_refused_where_its_check_fails(monkeypatch):
    """A load asks the machine whether torch's fused kernel holds (fused_attention_holds); where a query's
    bits change with its company, the answer is no, and the engine keeps its own key blocks."""
    assert attention_checks.fused_attention_holds(torch.float32)
    calls = iter(range(1_000_000))
    real = attention_checks.fused_attention

    def flaky(*args):
        return real(*args) * (1 + 2**-20 * (next(calls) % 2))

    monkeypatch.setattr(attention_checks, "fused_attention", flaky)
    assert not attention_checks.fused_attention_holds(torch.float32)


@ATTENDS
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_matches_sdpa_across_blocks_and_windows(dtype, attend):
    """Past one key block and one query chunk, with a sliding window: the result is attention's."""
    g = torch.Generator().manual_seed(7)
    held, new, window = 700, 300, 200
    keys, values = _cache(held, held, 2, dtype, g)
    queries = torch.randn(1, 6, new, 32, generator=g).to(dtype)
    q_pos, k_pos = torch.arange(held - new, held)[:, None], torch.arange(held)[None, :]
    mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
    expected = F.scaled_dot_product_attention(
        queries.float(), keys.float(), values.float(), attn_mask=mask, enable_gqa=True
    )
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    out = attend(queries, keys, values, None, window)
    torch.testing.assert_close(out.float(), expected.transpose(1, 2), atol=atol, rtol=0)


def test_onednn_holds_each_weight_once():
    """The packed copy replaces a layer's own weight (the memory of one copy, not two); a tied lm_head
    keeps the embedding's weight, which the embedding still reads."""
    model = _tiny_llama(torch.float32, invariant_mode=True)
    layers = [m for m in model.modules() if isinstance(m, invariant.InvariantLinear)]
    tied = model.lm_head
    assert tied.weight is model.model.embed_tokens.weight
    assert tied.weight.untyped_storage().nbytes() == 512 * 128 * 4
    for m in layers:
        if m is not tied:
            assert m.packed is not None and m.weight.untyped_storage().nbytes() == 4, m


def test_portable_keeps_the_model_weights():
    model = _tiny_llama(torch.float32, invariant_mode=True, kernels="portable")
    layers = [m for m in model.modules() if isinstance(m, invariant.InvariantLinear)]
    assert layers and all(m.packed is None and m.weight.is_contiguous() for m in layers)


def test_kernels_resolve_by_device_and_dtype():
    assert invariant.resolve("auto", torch.float32, "cpu") == "onednn"
    assert invariant.resolve("portable", torch.float32, "cpu") == "portable"
    assert invariant.resolve("auto", torch.bfloat16, "cuda") == "portable"
    with pytest.raises(ValueError, match="portable"):
        invariant.resolve("onednn", torch.float32, "cuda")
    with pytest.raises(ValueError, match="unknown kernels"):
        invariant.resolve("triton", torch.float32, "cpu")
    assert invariant.portable_rows(torch.float32, "cuda") == (64, 64)  # one shape every call
    assert invariant.portable_rows(torch.bfloat16, "cpu") == (16, 16)


def test_torch_float32_linear_is_not_row_invariant():
    """Known to bite (on the CPUs seen so far; skipped, saying so, where not): torch's float32 F.linear
    (MKL) gives a row alone a different result than the same row among others, so the equalities above
    test something."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(1536, 576, generator=g) / 24
    x = torch.randn(9, 576, generator=g)
    alone = torch.cat([F.linear(x[i : i + 1], weight) for i in range(9)])
    if torch.equal(F.linear(x, weight), alone):
        pytest.skip(
            "torch's float32 linear happens to be row-invariant on this CPU: the control shows nothing"
        )


def test_torch_sdpa_is_not_query_invariant():
    """Known to bite: a query among others under a causal mask differs from the same query alone."""
    g = torch.Generator().manual_seed(5)
    keys, values = _cache(40, 40, 2, torch.float32, g)
    queries = torch.randn(1, 6, 5, 32, generator=g)
    mask = torch.arange(40)[None, :] <= torch.arange(35, 40)[:, None]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=True)
    alone = torch.cat(
        [
            F.scaled_dot_product_attention(
                queries[:, :, j : j + 1], keys[:, :, : 36 + j], values[:, :, : 36 + j], enable_gqa=True
            )
            for j in range(5)
        ],
        dim=2,
    )
    if torch.equal(out, alone):
        pytest.skip("torch's sdpa happens to be query-invariant on this CPU: the control shows nothing")


def test_tiny_llama_plain_float32_is_not_invariant():
    """Known to bite, at the model level: the same model with torch's kernels (sdpa) is not invariant."""
    model = _tiny_llama(torch.float32, invariant_mode=False)
    ids = [(37 * i + 11) % 512 for i in range(60)]
    one, rounds = _logits_one_at_a_time_and_in_rounds(model, ids, 9, 5)
    if torch.equal(one, rounds):
        pytest.skip("torch's float32 kernels happen to agree on this CPU: the control shows nothing")


def test_the_load_keeps_calls_of_the_proven_size_and_refuses_what_it_cannot_prove(monkeypatch):
    """make_invariant gives every packed layer calls of ROW_POLICY's most rows once check_linear proves
    them here; where the check fails (injected), NotInvariant."""
    most = invariant.ROW_POLICY[torch.float32][2]
    assert invariant.proven_rows(torch.float32, {(96, 160)}, 2) == most
    model = _tiny_llama(torch.float32, invariant_mode=False)
    make_invariant(model, "onednn", padding=2)
    assert {m.max_rows for m in model.modules() if isinstance(m, invariant.InvariantLinear)} == {most}

    def fails(*args, **kwargs):
        raise invariant.NotInvariant("injected")

    monkeypatch.setattr(invariant, "check_linear", fails)
    with pytest.raises(invariant.NotInvariant):
        make_invariant(_tiny_llama(torch.float32, invariant_mode=False), "onednn", padding=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "window", "softcap", "sessions"),
    [
        (9, 3, 64, None, None, [(1000, 5), (40, 1), (300, 9), (1, 1), (700, 700)]),  # SmolLM2's heads
        (12, 2, 128, None, None, [(257, 5), (256, 3), (512, 2)]),  # Qwen2.5's, at block edges
        (4, 1, 256, 512, 50.0, [(600, 5), (40, 40), (300, 1)]),  # Gemma's, windowed and capped
        (4, 4, 32, 300, None, [(1317, 600), (20, 4)]),  # query chunks past QUERY_CHUNK
    ],
)
def test_batched_attention_gives_each_query_its_bits_alone(
    heads, kv_heads, dim, window, softcap, sessions, dtype
):
    """A batch of sessions' attention in one set of calls (a GPU's path) equals each session's own call of
    block_attention bit for bit: the padded rows and key blocks change nothing."""
    g = torch.Generator().manual_seed(len(sessions))
    qs, ks, vs = [], [], []
    for held, n in sessions:
        qs.append(torch.randn(1, heads, n, dim, generator=g).to(dtype))
        ks.append(torch.randn(1, kv_heads, held, dim, generator=g).to(dtype))
        vs.append(torch.randn(1, kv_heads, held, dim, generator=g).to(dtype))
    own = zip(qs, ks, vs, strict=True)
    alone = torch.cat([block_attention(q, k, v, None, window, softcap) for q, k, v in own], 1)
    batched = batched_block_attention(
        torch.cat(qs, 2), ks, vs, [n for _, n in sessions], None, window, softcap
    )
    assert torch.equal(batched, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loads_question_of_the_batched_attention_says_yes_where_it_holds(dtype):
    """What a load off a CPU asks of its machine (batched_attention_holds) answers yes here, where the
    test above shows the batched path gives each query its bits alone."""
    assert attention_checks.batched_attention_holds(dtype)


def test_a_batch_whose_rows_differ_is_seen_to_differ(monkeypatch):
    """The load's question can say no: padding that changed a row's bits would be caught."""
    real = attention_checks.batched_block_attention

    def off(*args, **kwargs):
        return real(*args, **kwargs) * (1 + 2**-20)

    monkeypatch.setattr(attention_checks, "batched_block_attention", off)
    assert not attention_checks.batched_attention_holds(torch.float32)
