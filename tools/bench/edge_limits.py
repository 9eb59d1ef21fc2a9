"""The edge app's limits, measured: `python -m tools.bench.edge_limits` (the demo pair, `draftwire serve` and
`draftwire edge` as subprocesses, aiohttp as client). Prints one table row per request; the rows are in
docs/edge-app.md."""

import asyncio
import json
import time
from pathlib import Path

import aiohttp

from tools.rig.serverproc import EdgeProcess, ServerProcess

DEMO = Path("models/demo")


async def post(s, url, body=None, raw=None, headers=None):
    t = time.perf_counter()
    data = raw if raw is not None else json.dumps(body).encode()
    async with s.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
        text = await r.read()
        return r.status, time.perf_counter() - t, text[:160]


async def main(edge_url, verifier):
    rows = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        u = edge_url

        def rec(name, st, dt, extra=""):
            rows.append((name, st, dt))
            print(f"| {name} | {st} | {dt * 1000:.0f} ms | {extra}", flush=True)

        st, dt, _ = await post(
            s, u + "v1/chat/completions", {"messages": [{"role": "user", "content": "x" * ((1 << 20) + 10)}]}
        )
        rec("chat body 1 MiB + 10 bytes (over --max-body)", st, dt)
        content = "word " * ((1 << 20) // 5 - 40)
        st, dt, t = await post(
            s,
            u + "v1/chat/completions",
            {"messages": [{"role": "user", "content": content}], "max_tokens": 8},
        )
        rec(
            f"chat body just under 1 MiB ({len(content)} chars, far over the context)",
            st,
            dt,
            t.decode(errors="replace")[:90],
        )
        from edge_client.llama_runtime import Llama

        llm = Llama(model_path=str(DEMO / "draft-q8_0.gguf"), vocab_only=True, verbose=False)
        words = " ".join(f"w{i}" for i in range(3000))
        for n, mt in ((1016, 8), (1020, 8), (1024, None), (4000, 8)):
            ids = llm.tokenize(words.encode(), add_bos=True, special=False)[:n]
            prompt = llm.detokenize(ids[1:]).decode()
            real = len(llm.tokenize(prompt.encode(), add_bos=True, special=False))
            body = {"prompt": prompt, "temperature": 0, **({"max_tokens": mt} if mt else {})}
            st, dt, t = await post(s, u + "v1/completions", body)
            rec(
                f"completion prompt of {real} tokens, max_tokens {mt} (context 1024)",
                st,
                dt,
                t.decode(errors="replace")[:70],
            )
        for name, body in [
            ("max_tokens 2^40", {"prompt": "hi", "max_tokens": 2**40}),
            ("top_k 2^40", {"prompt": "hi", "top_k": 2**40}),
            ("model gpt-4o", {"prompt": "hi", "model": "gpt-4o"}),
        ]:
            st, dt, _ = await post(s, u + "v1/completions", body)
            rec(name, st, dt)
        st, dt, _ = await post(s, u + "v1/completions", raw=b"[" * 100_000)
        rec("JSON nested 100k deep", st, dt)
        st, dt, _ = await post(
            s, u + "v1/completions", raw=b'{"prompt":"hi"}', headers={"Content-Type": "text/plain"}
        )
        rec("text/plain body", st, dt)
        st, dt, _ = await post(s, u + "api/conversations", {}, headers={"Origin": "https://evil.example"})
        rec("Origin https://evil.example", st, dt)
        async with s.get(u + "api/conversations", headers={"Host": "rebind.example"}) as r:
            rec("Host rebind.example (DNS rebinding)", r.status, 0)
        # 200 at once, each 32 tokens, with /health probed meanwhile
        body = {"prompt": "def f(x):\n", "max_tokens": 32, "temperature": 0}
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(post(s, u + "v1/completions", body)) for _ in range(200)]
        health = []
        while not all(t.done() for t in tasks):
            t = time.perf_counter()
            async with s.get(u + "health") as r:
                await r.read()
                health.append((r.status, time.perf_counter() - t))
            await asyncio.sleep(0.05)
        res = [t.result() for t in tasks]
        by = {}
        for st, dt, _ in res:
            by.setdefault(st, []).append(dt)
        for st, dts in sorted(by.items()):
            print(
                f"| 200 concurrent completions (32 tokens): {len(dts)} x {st} | {st} "
                f"| max {max(dts) * 1000:.0f} ms |",
                flush=True,
            )
        hs = sorted(h[1] for h in health)
        print(
            f"| /health during that load: {len(hs)} probes, statuses {sorted(set(h[0] for h in health))} "
            f"| | p50 {hs[len(hs) // 2] * 1000:.1f} ms, max {hs[-1] * 1000:.1f} ms "
            f"| total {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        await post(s, u + "v1/completions", {"prompt": "hi", "max_tokens": 4})  # a first turn that works
        verifier.stop()
        st, dt, t = await post(s, u + "v1/completions", {"prompt": "hi", "max_tokens": 4})
        rec("completion after the verifier was stopped", st, dt, t.decode(errors="replace")[:80])


if __name__ == "__main__":
    import tempfile

    with (
        ServerProcess(DEMO / "target") as v,
        EdgeProcess(v.address, DEMO / "draft-q8_0.gguf", db=Path(tempfile.mkdtemp()) / "e.sqlite3") as e,
    ):
        asyncio.run(main(e.url, v))
